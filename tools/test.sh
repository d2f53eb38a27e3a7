#!/usr/bin/env bash
# The README's test command: installs the dev tools and every distribution (editable) into the
# current Python environment, then runs the whole suite, slow tests included.
# Extra arguments go to pytest (e.g. `bash tools/test.sh -k plugins`).
# It refuses to install into an interpreter outside a virtual environment (the system's or
# the user's global one) unless ALLOW_GLOBAL_INSTALL=1 says that is intended.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
editables=(-e polygateway-core)
for project in plugins/*/pyproject.toml; do
  [ -e "$project" ] || continue
  editables+=(-e "$(dirname "$project")")
done

in_venv='import os, sys; sys.exit(0 if sys.prefix != sys.base_prefix or os.environ.get("CONDA_PREFIX") == sys.prefix else 1)'
if ! "$python" -c "$in_venv"; then
  if [ "${ALLOW_GLOBAL_INSTALL:-}" != "1" ]; then
    where=$("$python" -c 'import sys; print(sys.prefix)')
    {
      echo "tools/test.sh: $python ($where) is not a virtual environment; not installing into it."
      echo "  make one first:  python3 -m venv .venv && . .venv/bin/activate && bash tools/test.sh"
      echo "  or, to install into this interpreter anyway:  ALLOW_GLOBAL_INSTALL=1 bash tools/test.sh"
    } >&2
    exit 2
  fi
  echo "tools/test.sh: installing into the global interpreter $python (ALLOW_GLOBAL_INSTALL=1)" >&2
fi

echo "tools/test.sh: installing the dev tools and every distribution (editable) into $("$python" -c 'import sys; print(sys.prefix)')" >&2
"$python" -m pip install -q -r requirements-dev.txt "${editables[@]}"
exec "$python" -m pytest -q "$@"
