#!/bin/bash
# The wall-clock half: the tree before the open gate (OLD: a git worktree of 33a2abb with this
# commit's benchmarks/bench_scheduler.py copied in, and kvcached/_vmm*.so from the editable
# install) against main, 4 runs of 3 rounds each, alternated (old-new, new-old, ...).
# SC: a folder holding ../scheduler_loop_before_after/sitecustomize.py (drops the editable
# install's finders, so that PYTHONPATH's kvcached is the one imported).
#   OLD=/tmp/wt-old SC=/tmp/oldsc OUT=/tmp/ab bash run.sh; python3 ratios.py /tmp/ab
P=${P:-.nox/kvcached-env/bin/python}
P=$(realpath "$P")
MAIN=$(git rev-parse --show-toplevel)
A="--workload decode-full --rounds 3 --blocks 10240 --concurrency 128 --max-tokens 96 --page-size 524288 --schedulers sync"
run() { # side round
  if [ "$1" = old ]; then (cd "$OLD" && PYTHONPATH=$SC:$OLD $P benchmarks/bench_scheduler.py $A --out "$OUT/old-$2" > "$OUT/old-$2.log" 2>&1)
  else (cd "$MAIN" && $P benchmarks/bench_scheduler.py $A --out "$OUT/new-$2" > "$OUT/new-$2.log" 2>&1); fi
  echo "$1 round $2 rc=$? $(date +%T)" >> "$OUT/progress"
}
mkdir -p "$OUT"
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then run old $r; run new $r; else run new $r; run old $r; fi
done
