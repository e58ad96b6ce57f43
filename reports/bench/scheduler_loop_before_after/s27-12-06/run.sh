#!/bin/bash
# Scheduler-loop benchmark (seams installed once), the session's base tree (9e0bef7) against main, alternated per round.
# /tmp/s27sc holds ../sitecustomize.py; /tmp/s27base is a worktree of 9e0bef7 with _vmm*.so and this tree's bench_scheduler_loop.py copied in.
P=/work/main/.nox/kvcached-env/bin/python
A="--pairs 3 --blocks 10000,100000 --concurrency 64,256 --schedulers async --page-size 65536"
run() { # side round
  if [ $1 = old ]; then (cd /tmp/s27base && PYTHONPATH=/tmp/s27sc:/tmp/s27base $P benchmarks/bench_scheduler_loop.py $A --out /tmp/slb27/old-$2 > /tmp/slb27/old-$2.log 2>&1)
  else (cd /work/main && $P benchmarks/bench_scheduler_loop.py $A --out /tmp/slb27/new-$2 > /tmp/slb27/new-$2.log 2>&1); fi
  echo "$1 round $2 rc=$? $(date +%T)" >> /tmp/slb27/progress
}
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then run old $r; run new $r; else run new $r; run old $r; fi
done
echo DONE >> /tmp/slb27/progress
