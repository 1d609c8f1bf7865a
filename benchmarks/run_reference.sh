#!/usr/bin/env bash
# The reference run quoted in docs/benchmarks.md: tiersave bench on a 3 GB Llama-3-8B-like state
# (fp32 weights + Adam moments), one warm-up and three timed checkpoints per method, against the raw
# device and the peers, in one process on one directory. Writes benchmarks/results/<UTC stamp>.{txt,json,png}
# with the machine's load average before and after (the machine is shared: quote ratios, not GB/s).
#
# Usage: benchmarks/run_reference.sh [DIR]   (DIR on the file system to measure; default /tmp/tiersave-bench)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-${TMPDIR:-/tmp}/tiersave-bench}
OUT=benchmarks/results
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
{
    echo "\$ uptime"; uptime
    echo "\$ tiersave bench $DIR --model llama3-8b --size 3GB --checkpoints 3 --warmup 1 --output $OUT/$STAMP.json --plot $OUT/$STAMP.png"
    .venv/bin/tiersave bench "$DIR" --model llama3-8b --size 3GB --checkpoints 3 --warmup 1 \
        --output "$OUT/$STAMP.json" --plot "$OUT/$STAMP.png"
    echo "\$ uptime"; uptime
} | tee "$OUT/$STAMP.txt"
