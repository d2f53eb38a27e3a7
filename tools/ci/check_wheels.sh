#!/usr/bin/env bash
# Packaging check: build a wheel of every distribution, install them into a fresh venv
# (dependencies from the package index, nothing from this checkout), and assert that
# `pgw plugins list --json` lists every plugin as loaded. Editable installs can hide
# entry-point metadata mistakes; wheels cannot.
# Usage: check_wheels.sh [PROJECT_DIR...] (default: polygateway-core and every plugins/*).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
python="${PYTHON:-python3}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ $# -gt 0 ]; then
  projects=()
  for project in "$@"; do projects+=("$(cd "$project" && pwd)"); done
else
  projects=("$repo/polygateway-core")
  for pyproject in "$repo"/plugins/*/pyproject.toml; do
    [ -e "$pyproject" ] || continue
    projects+=("$(dirname "$pyproject")")
  done
fi

for project in "${projects[@]}"; do
  "$python" -m build --wheel --no-isolation --outdir "$work/wheels" "$project" >"$work/build.log" \
    || { cat "$work/build.log" >&2; echo "check_wheels: building $project failed" >&2; exit 1; }
done

"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -qq "$work"/wheels/*.whl

# Run from the temp dir with a clean environment: only the installed wheels are importable.
cd "$work"
env -u PGW_PLUGINS -u PYTHONPATH "$work/venv/bin/pgw" plugins list --json >"$work/plugins.json"

"$work/venv/bin/python" - "$work/plugins.json" "${projects[@]}" <<'PY'
import json
import sys
import tomllib
from pathlib import Path

listed = {row["name"]: row for row in json.loads(Path(sys.argv[1]).read_text())}
problems = []
for project in sys.argv[2:]:
    meta = tomllib.loads((Path(project) / "pyproject.toml").read_text())["project"]
    name = meta["name"]
    if name != "polygateway-core" and "polygateway" not in meta.get("entry-points", {}):
        problems.append(f"{name}: declares no entry point in group 'polygateway'")
        continue
    row = listed.get(name)
    if row is None:
        problems.append(f"{name}: not listed by `pgw plugins list --json`")
    elif row["status"] != "loaded":
        problems.append(f"{name}: status {row['status']}: {row['error']}")
    else:
        provides = "; ".join(f"{k}: {', '.join(v)}" for k, v in row["provides"].items())
        print(f"check_wheels: {name} {row['version']} loaded ({provides})")
if problems:
    print("\n".join(f"check_wheels: {p}" for p in problems), file=sys.stderr)
    sys.exit(1)
PY
