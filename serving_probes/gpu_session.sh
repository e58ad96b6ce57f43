#!/bin/bash
# One session on a borrowed GPU host with no network (the H200 of reports/gpu). Run from the
# repository root there. The bundle of `python -m serving_probes.gpu_bundle build --out
# .gpu/bundle` goes there a part per call; then every run goes in the foreground of a call of its
# own and comes back packed with that call.
#
# Each call is a fresh command on a machine that stays up only ~30 s between calls and carries at
# most 64 MiB (the tracked tree, ~7 MB, plus the parts named to travel; `carry` names them):
#   1. stage                                  (carrying .gpu/bundle/core.part01)
#   2. stage                                  (carrying core.part02)
#   3. stage && BUNDLE_GROUPS=core install && fg 120 ...  (carrying core.part03 and manifest.json;
#                                              moe.part01 in a call of its own first for the MoE rows)
#   4. chunk 560 ARGS, or fg 560 NAME CMD...  as the lease allows
# Issue each call the moment the last one returns. Twice (12-04) a machine went back between calls
# while a whole-matrix run went on in the background, losing it at 77 and 84 of ~100 case runs;
# the machine that ran each part in the foreground of its own call stayed through four calls.
# Leave a minute of the lease for the last call's files: with 43 s left (12-04) none came back.
# Keep a call's timeouts together (fg's SECS + 15 s of kill grace each, and a pack each) well under
# its 600 s: 12-05 evening, a call of fg 200 + fg 370 never answered and took 623 s of the lease
# with it (its two runs, a server and the sharing run's first part, were lost).
#
# H200 timings (12-04): staging 10 s, install 52-57 s; the V1 matrix with 8 jobs: hybrids 406 s,
# llama and qwen3 244 s; nemotron_h alone 373 s; V2 dense mp rows 154 s; the GPU engine tests
# 374 s; bench_serving 1b: a server ~85 s to start, a phase ~33 s (7 phase runs in 510 s).
# The next session's calls, in order of need (issue 30). Done 12-07 morning (an H100, 1,612 s of
# the lease): the map-rate probe, the 1b run's 5 rounds on 064ae57 (reports/gpu/serving/run-12-07)
# and the dense in-process conformance rows. Done 12-07 afternoon (an H100 after one refused start,
# 181 s lost; servers of 89-142 s with their phases): the sharing run with the 1 s
# grace (reports/gpu/sharing-serve: native 204 s, shared 105 s, retrial 182 s; a native side under
# fg 220 was cut) and 5 of the 1b run's 10 servers (reports/gpu/serving/run-12-07b: fg 470
# --time-budget 460 with the install, 3 servers; fg 280 --time-budget 270, 2). Done 12-07 evening (an
# H200 after two refused starts, 181 s lost; servers of 139-177 s with their phases): 8 of the 1b
# run's 10 servers on d4ff39b (reports/gpu/serving/run-12-07c: install + fg 480 --time-budget 470, 2
# servers; fg 560 / 550, 3; fg 500 / 490, 3). 12-07 night: no machine (loans paused; one refused
# start, 91 s). 12-08 night: no machine (nine refused starts, 1,411 s of the lease; the bundle
# rebuilt in 229 s on a fresh checkout). Next, in order:
#   1. the 1b run, 5 rounds, on a host that holds its pace (run-12-07c's servers ran the same vLLM
#      code up to 1.3x apart), on a tree with 7bcb2e3 (one refill a schedule: a CPU prefill step
#      1.56x -> 1.29x native, async); it cannot be resumed on another tree;
#   1b. where a decode step's extra scheduler time goes on the GPU (the CPU's split:
#      reports/bench/scheduler_decode_sampled; since 045d37c the running requests' gate is asked
#      once per schedule call once every CLEAN block is backed, which the split should show):
#      one sampled round, saturation only, ~200 s on an H100:
#      fg 300 sampled python3 benchmarks/bench_serving.py --device cuda --models 1b --rounds 1 \
#          --phases saturation --step-times --step-samples 100 --out /tmp/gpu-out/sampled \
#          --logs /tmp/gpu-out/sampled/logs      (its report splits a decode step by whose code ran)
#   2. (moot since d4ff39b: random prompts hit 1.1-1.9% on both sides) the cached-block cap's
#      ablation, --kvcached-env KVCACHED_MAX_CACHED_BLOCKS=-1;
#   3. the serving rows the default run leaves out, a model per run: --models 1b-eager, then
#      1b-v1, then hybrid;
#   4. the sharing run with the 250 ms grace (three calls, ~500 s), now with its handover step:
#      how long B's burst sent as A's ends waits for A's memory (CPU, 250 ms: 0.156 s against 0.065 s).
#      If the lease ends first, the next session can finish the same run only on the same tree:
#      commit the partial report, then there `mkdir -p /tmp/gpu-out/serving && cp
#      reports/gpu/serving/RUN/serving.partial.json /tmp/gpu-out/serving/` before `--resume` (the
#      lent host has no checkout: nothing checks the tree).
# The map-rate probe: `python3 -m serving_probes.map_rate_probe --device cuda --out
# /tmp/gpu-out/map-rate.json` (8 s after install; `--switch-interval-ms 0.5` for the GIL's share;
# `--render --out reports/gpu/map-rate/map-rate.json` renders the committed report again here).
# Parts are 32 MiB since the end of 12-07 (the tracked tree grew to 21.6 MiB with that day's reports;
# at 19.1 MiB a call with a 44 MiB part was refused as over 64 MiB; 48 MiB parts stopped fitting at
# 18 MB on 12-05); rebuild the bundle with `gpu_bundle build` if its parts are larger.
#   fg 560 serving python3 benchmarks/bench_serving.py --device cuda --models 1b --rounds 3 --step-times \
#       --out /tmp/gpu-out/serving --logs /tmp/gpu-out/serving/logs
#       --time-budget SECS (a few s under fg's): no server starts that would not end in the call;
#       then the same with --resume in the next calls (a round of 3 phases: ~6 min; 3 rounds, the
#       fewest a verdict takes, in ~3 calls); --kvcached-env KVCACHED_HOLD_STEPS=0 is the "before"
#   fg 560 sharing python3 -m conformance.sharing --device cuda --quick --out /tmp/gpu-out/sharing --sides native
#       then --sides shared, then --sides retrial (a call each: 12-05, the whole run passed 470 s;
#       each part saves /tmp/gpu-out/sharing/run-state.json, which the next reads)
#   chunk 560 --jobs 2 --model-runner v2 --archetypes nemotron_h,qwen3_next --faults none \
#       --layouts inproc --no-controls
# (chunk runs write into one conformance run, h200 or what --run-id says: `python -m conformance
# --device cuda --render h200` here joins them into one report.)
#
#   stage              copy the bundle parts this call carried into $STAGE (persists while warm)
#   install            verify + install the bundle into $TARGET, build kvcached there (BUNDLE_GROUPS=core: dense
#                      models only, the moe part not staged: a call fewer)
#   chunk SECS ARGS    the CUDA conformance matrix (ARGS: --archetypes ... ) in the foreground, then pack
#   fg SECS NAME CMD   any run in the foreground (log $R/NAME.log), then pack
#   before             build the kvcached of .gpu/before.tar (`git archive REV pyproject.toml CMakeLists.txt
#                      csrc kvcached README.md`) into $BEFORE/site: a run with PYTHONPATH=$BEFORE/site:$SITE:$WORK
#                      measures that commit's kvcached beside this tree's (a before/after on one machine)
#   pack               pack $R into $OUT (gpu-out.txz.NN, 15 MiB parts, KV snapshots left out)
set -u
STAGE=/tmp/kvc-stage; TARGET=/tmp/kvc; WORK=/tmp/kvc-repo; R=/tmp/gpu-out; BEFORE=/tmp/kvc-before
SITE=$TARGET/site
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0

pack() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p $R; nvidia-smi > $R/nvidia-smi.txt 2>&1
    rm -f /tmp/gpu-out.txz; tar -C /tmp --exclude="*.npz" -I "xz -T0 -3" -cf /tmp/gpu-out.txz gpu-out 2>/dev/null; du -sh /tmp/gpu-out /tmp/gpu-out.txz
    split -b 15m -d /tmp/gpu-out.txz $OUT/gpu-out.txz.
    ls -la $OUT
}

step() {  # step NAME CMD...: run CMD in $WORK, log to $R/NAME.log, record rc and seconds
    local name=$1; shift
    local t0=$(date +%s)
    echo "$(date +%T) start $name" >> $R/steps
    (cd $WORK && "$@") > $R/$name.log 2>&1
    local rc=$?
    echo "$(date +%T) end $name rc=$rc $(( $(date +%s) - t0 ))s" >> $R/steps
}

orphans() {  # what a run cut by its timeout left: servers, EngineCores (titled VLLM::EngineCore), benchmark clients
    pkill -9 -f conformance.engine; pkill -9 -f vllm.entrypoints; pkill -9 -f "[V]LLM::EngineCore"; pkill -9 -f bench_client.py; sleep 1
}

workdir() {  # the repository copy the runs use, with the kvcached extension built at install
    [ -d $WORK ] || { cp -a . $WORK; rm -rf $WORK/.gpu/bundle; cp $SITE/kvcached/_vmm*.so $WORK/kvcached/; }
    mkdir -p $R; export PYTHONPATH=$SITE:$WORK
}

case "${1:-}" in
stage)
    mkdir -p $STAGE; cp -v .gpu/bundle/* $STAGE/; ls -la $STAGE; df -h /tmp | tail -1 ;;
install)
    t0=$(date +%s)
    python3 -m serving_probes.gpu_bundle install --bundle $STAGE --target $TARGET --repo . --groups ${BUNDLE_GROUPS:-core,moe}
    rc=$?; echo "install rc=$rc $(( $(date +%s) - t0 ))s"; ls $SITE | head -50 | tr '\n' ' ' ;;
fg)
    shift; secs=$1; name=$2; shift 2; workdir
    step $name timeout -k 15 $secs "$@"
    orphans; cat $R/steps; tail -n 15 $R/$name.log; pack ;;
chunk)
    shift; secs=$1; shift; workdir
    step conformance-$(date +%H%M%S) timeout -k 15 $secs python3 -m conformance --device cuda \
        --reports-dir $R/conformance --run-id h200 "$@"
    orphans; cat $R/steps; pack ;;
before)
    rm -rf $BEFORE; mkdir -p $BEFORE/src; tar -C $BEFORE/src -xf .gpu/before.tar
    python3 -m pip install -q --no-build-isolation --no-deps --no-index --target $BEFORE/site $BEFORE/src
    echo "before rc=$?"; PYTHONPATH=$BEFORE/site:$SITE python3 -c "import kvcached.memory as m; print(m.__file__)" ;;
pack)
    pack ;;
*)
    echo "usage: $0 stage | install | before | chunk SECS ARGS... | fg SECS NAME CMD... | pack" >&2; exit 2 ;;
esac
