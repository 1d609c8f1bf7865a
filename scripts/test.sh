#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit, format, CLI, reliability, storage incl. the real
# SeaweedFS S3 server, multi-rank gloo, integration). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
