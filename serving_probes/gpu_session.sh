#!/bin/bash
# One session on a borrowed GPU host with no network (the H200 of reports/gpu): the bundle of
# `python -m serving_probes.gpu_bundle build --out .gpu/bundle` goes there a part per call, then
# the CUDA runs go in the background and come back packed. Run from the repository root there.
#
# Where each call is a fresh command on a machine that stays up only ~30 s between calls and
# carries at most 64 MiB (the tracked tree, ~7 MB, plus the parts named to travel), the calls are:
#   1. stage                      (carrying .gpu/bundle/core.part01)
#   2. stage                      (carrying core.part02 and manifest.json)
#   3. stage && install && chunk 470 --jobs 8 --archetypes <hybrids>   (carrying moe.part01)
#   4. chunk 520 --jobs 8 --archetypes llama,qwen3; then what the lease allows, in the foreground
# Issue each call the moment the last one returns: a machine idle for 30 s goes back, and the runs
# on it with it. Twice (12-04, third and fourth sessions) a machine went back between calls while
# a whole-matrix run went on in the background (start/wait), losing it at 77 and 84 of ~100; the
# machine that ran each part in the foreground of its own call (chunk) stayed through four calls.
# Each call returns within its limit and leaves $OUT/gpu-out.txz.NN (15 MiB parts, KV snapshots
# left out): cat them and untar. H200 timings (12-04): staging 10 s, install 56 s, the V1 matrix
# 373 s alone. Multiprocess engines whose worker had just written its model hung at start-up
# (GNU OpenMP and fork; models are written in a child interpreter since b372cb1).
#
#   stage              copy the bundle parts this call carried into $STAGE (persists while warm)
#   install            verify + install the bundle into $TARGET, build kvcached there
#   start [SECS]       copy the repo to $WORK, start `work` in its own session (setsid), then wait
#   wait SECS          wait up to SECS for `work`, then pack $R into $OUT
#   work               (background) the runs, each step's log in $R
#   serve ARGS         (after work) the serving benchmark, detached, then wait
#   chunk SECS ARGS    part of the CUDA matrix (ARGS: --archetypes ...) in the foreground, then pack
#   fg SECS NAME CMD   any run in the foreground, then pack; the serving benchmark goes on over calls:
#                      fg 560 serving python3 benchmarks/bench_serving.py --device cuda --models 1b \
#                          --rounds 5 --out $R/serving [--resume]   (--resume from the 2nd call on)
# Leave a minute of the lease for the last call's files: with 43 s left (12-04) none came back.
set -u
STAGE=/tmp/kvc-stage; TARGET=/tmp/kvc; WORK=/tmp/kvc-repo; R=/tmp/gpu-out
SITE=$TARGET/site
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0

pack() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p $R; nvidia-smi > $R/nvidia-smi.txt 2>&1
    rm -f /tmp/gpu-out.txz; tar -C /tmp --exclude="*.npz" -I "xz -T0 -3" -cf /tmp/gpu-out.txz gpu-out 2>/dev/null; du -sh /tmp/gpu-out /tmp/gpu-out.txz
    split -b 15m -d /tmp/gpu-out.txz $OUT/gpu-out.txz.
    ls -la $OUT
}

wait_work() {
    local end=$(( $(date +%s) + $1 ))
    # A machine that went back between calls comes fresh: nothing to wait for.
    [ -e $R/steps ] || { echo "no work on this machine ($R/steps missing): it is a fresh one"; return 1; }
    while [ $(date +%s) -lt $end ] && ! [ -e $R/DONE ]; do sleep 5; done
    echo "== steps"; cat $R/steps 2>/dev/null
    echo "== tail of the current step"; tail -n 25 "$(ls -t $R/*.log 2>/dev/null | head -1)" 2>/dev/null
    pack
}

step() {  # step NAME CMD...: run CMD in $WORK, log to $R/NAME.log, record rc and seconds
    local name=$1; shift
    local t0=$(date +%s)
    echo "$(date +%T) start $name" >> $R/steps
    (cd $WORK && "$@") > $R/$name.log 2>&1
    local rc=$?
    echo "$(date +%T) end $name rc=$rc $(( $(date +%s) - t0 ))s" >> $R/steps
}

case "${1:-}" in
stage)
    mkdir -p $STAGE; cp -v .gpu/bundle/* $STAGE/; ls -la $STAGE; df -h /tmp | tail -1 ;;
install)
    t0=$(date +%s)
    python3 -m serving_probes.gpu_bundle install --bundle $STAGE --target $TARGET --repo . --groups core,moe
    rc=$?; echo "install rc=$rc $(( $(date +%s) - t0 ))s"; ls $SITE | head -50 | tr '\n' ' ' ;;
start)
    rm -rf $WORK $R; mkdir -p $R; : > $R/steps; cp -a . $WORK; rm -rf $WORK/.gpu/bundle
    cp -v $SITE/kvcached/_vmm*.so $WORK/kvcached/
    setsid nohup bash $WORK/serving_probes/gpu_session.sh ${WORKSTEPS:-work} > $R/session.out 2>&1 < /dev/null &
    sleep 2; wait_work "${2:-540}" ;;
wait)
    wait_work "${2:-540}" ;;
work)
    export PYTHONPATH=$SITE:$WORK
    nvidia-smi > $R/nvidia-smi-start.txt 2>&1
    # One harness at a time, so that no run's timings are another's.
    step conformance-v1 python3 -m conformance --device cuda --jobs 8 --reports-dir $R/conformance --run-id h200
    # A compile killed mid-write could leave a broken AOT artifact in vLLM's cache (a guess for
    # run-12-04's engine-test failures, after runs were killed): the tests compile afresh.
    rm -rf ~/.cache/vllm/torch_compile_cache
    step engine-tests python3 -m pytest -p no:xdist -q -rA --tb=short --basetemp=$R/pytest \
        tests/test_gpu_engine.py tests/test_vmm_cuda.py tests/test_gpu_serve.py
    # Model Runner V2 as vLLM picks it: the group the last run could not compare (llama, multiprocess),
    # then hybrids forced onto V2 (vLLM's default for them is V1): does native V2 serve them at all?
    step conformance-v2 python3 -m conformance --device cuda --jobs 2 --model-runner vllm \
        --archetypes llama --layouts mp --reports-dir $R/conformance-v2 --run-id h200-v2-mp
    step conformance-v2-hybrid python3 -m conformance --device cuda --jobs 2 --model-runner v2 \
        --archetypes nemotron_h,qwen3_next --faults none --layouts inproc --no-controls \
        --reports-dir $R/conformance-v2 --run-id h200-v2-hybrid
    # Two vllm serve engines sharing one budget on the GPU, against native's static split.
    step sharing python3 -m conformance.sharing --device cuda --quick --out $R/sharing
    # Last, as the lease allows: the serving benchmark writes serving.partial.json after every server.
    step serving python3 benchmarks/bench_serving.py --device cuda --models 1b --rounds 5 --out $R/serving
    touch $R/DONE ;;
short)   # what a short lease allows: the engine tests
    export PYTHONPATH=$SITE:$WORK
    step engine-tests python3 -m pytest -p no:xdist -q -rA --tb=short --basetemp=$R/pytest \
        tests/test_gpu_engine.py tests/test_gpu_serve.py
    touch $R/DONE ;;
fg)      # fg SECS NAME CMD...: CMD in the foreground of this call (in $WORK, its log $R/NAME.log), then pack
    shift; secs=$1; name=$2; shift 2
    [ -d $WORK ] || { cp -a . $WORK; rm -rf $WORK/.gpu/bundle; cp $SITE/kvcached/_vmm*.so $WORK/kvcached/; }
    mkdir -p $R; export PYTHONPATH=$SITE:$WORK
    step $name timeout -k 15 $secs "$@"
    pkill -9 -f conformance.engine; pkill -9 -f vllm.entrypoints; sleep 1; cat $R/steps; tail -n 15 $R/$name.log; pack ;;
chunk)   # chunk SECS ARGS...: part of the CUDA matrix in the foreground, inside this call, then pack
    # Every chunk writes into one run (h200), whose saved groups `--render h200` joins into one
    # report; the results of a chunk come back with its own call, whatever becomes of the machine.
    shift; secs=$1; shift
    [ -d $WORK ] || { cp -a . $WORK; rm -rf $WORK/.gpu/bundle; cp $SITE/kvcached/_vmm*.so $WORK/kvcached/; }
    mkdir -p $R; export PYTHONPATH=$SITE:$WORK
    step conformance-$(date +%H%M%S) timeout -k 15 $secs python3 -m conformance --device cuda \
        --reports-dir $R/conformance --run-id h200 "$@"
    pkill -9 -f conformance.engine; sleep 1; cat $R/steps; pack ;;
serve)   # serve ARGS...: the serving benchmark, detached, then wait
    shift; rm -f $R/DONE
    setsid nohup bash -c "export PYTHONPATH=$SITE:$WORK; source $WORK/serving_probes/gpu_session.sh fns; \
        step serving python3 benchmarks/bench_serving.py --device cuda --out $R/serving $*; touch $R/DONE" \
        > $R/serve.out 2>&1 < /dev/null &
    sleep 2; wait_work 560 ;;
fns) ;;
*)
    echo "usage: $0 stage|install|start [SECS]|wait SECS|work" >&2; exit 2 ;;
esac
