#!/usr/bin/env bash
# Set up .venv and run the demo: train a small GPT on the CPU with checkpoints, SIGKILL it partway,
# resume from the newest checkpoint, and check the resumed losses match an uninterrupted run bit for bit.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/tiersave demo "$@"
