#!/bin/bash
# Scheduler-loop benchmark, the tree before the fold (d54c1bd^) against main, alternated per round.
P=/work/main/.nox/kvcached-env/bin/python
A="--pairs 3 --blocks 10000,100000 --concurrency 256 --schedulers sync --page-size 65536"
run() { # side round
  if [ $1 = old ]; then (cd /tmp/wt-old && PYTHONPATH=/tmp/oldsc:/tmp/wt-old $P benchmarks/bench_scheduler_loop.py $A --out /tmp/slb/old-$2 > /tmp/slb/old-$2.log 2>&1)
  else (cd /work/main && $P benchmarks/bench_scheduler_loop.py $A --out /tmp/slb/new-$2 > /tmp/slb/new-$2.log 2>&1); fi
  echo "$1 round $2 rc=$? $(date +%T)" >> /tmp/slb/progress
}
mkdir -p /tmp/slb
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then run old $r; run new $r; else run new $r; run old $r; fi
done
echo DONE >> /tmp/slb/progress
