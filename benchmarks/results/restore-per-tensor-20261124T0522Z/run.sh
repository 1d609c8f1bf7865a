#!/bin/bash
# interleaved before/after: OLD = worktree of main at d644860, NEW = this branch
cd NEW
OUT=/tmp/pt-bench/out; mkdir -p $OUT
for rep in 1 2 3; do
  for tree in old new; do
    if [ $tree = old ]; then SRC=OLD/src; else SRC=NEW/src; fi
    echo "== single $tree $rep $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$SRC .venv/bin/python benchmarks/many_tensors.py --counts 10000 100000 --moe-mb 0 --restore-only --runs 3 --dir /tmp/pt-bench --json $OUT/single-$tree-$rep.json 2>&1 | grep -v "^run "
  done
done
for rep in 1 2 3; do
  for tree in old new; do
    if [ $tree = old ]; then SRC=OLD/src; else SRC=NEW/src; fi
    echo "== ranks $tree $rep $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$SRC timeout 600 .venv/bin/python benchmarks/ranks_many_tensors.py --ranks 2 --tensors-per-rank 50000 --tensor-kib 0.5 --runs 1 --dir /tmp/pt-bench --json $OUT/ranks-$tree-$rep.json 2>&1 | tail -1 | cut -c1-600
  done
done
echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
