#!/usr/bin/env bash
# The README's test command: installs the dev tools and every distribution (editable) into the
# current Python environment, then runs the whole suite, slow tests included.
# Extra arguments go to pytest (e.g. `bash tools/test.sh -k plugins`).
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
editables=(-e polygateway-core)
for project in plugins/*/pyproject.toml; do
  [ -e "$project" ] || continue
  editables+=(-e "$(dirname "$project")")
done

"$python" -m pip install -q -r requirements-dev.txt "${editables[@]}"
exec "$python" -m pytest -q "$@"
