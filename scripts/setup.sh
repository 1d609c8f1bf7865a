#!/usr/bin/env bash
# Create (or refresh) the project-local virtual environment .venv with tiersave and its development tools.
# Idempotent: a second run only checks that the pinned packages are present.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"tiersave needs Python >= 3.10, found {sys.version.split()[0]}")
PY
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# pip quietly; on failure show its output (minus this machine's notes about absent local indexes).
pipq() {
    local log
    log=$(mktemp)
    if ! .venv/bin/python -m pip --disable-pip-version-check "$@" >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2
        rm -f "$log"
        echo "setup: pip $* failed" >&2
        exit 1
    fi
    rm -f "$log"
}
# torch==2.13.0 is pinned in requirements-dev.txt: its CPU wheel lies on this machine's disk.
pipq install -r requirements-dev.txt
pipq install --no-deps --no-build-isolation -e .
.venv/bin/python -c "import tiersave, torch, numpy" 
