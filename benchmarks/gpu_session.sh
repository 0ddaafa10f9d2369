#!/usr/bin/env bash
# Device calls. On the device machine, from the repo root (with .whl carried):
#   bash benchmarks/gpu_session.sh WORD [WORD ...]
# tests: the GPU-marked tests (TESTS_PATHS: some files only, e.g. "$R/tests/test_hf_cache.py"); profile: cbtrace profile of NanoGPT and DLRM bf16, error tables
# (profile_models.py); capture: capture overhead with its breakdown (bench_capture.py);
# paper: benchmarks/paper_demos.py (the paper's figures beside ours, icicles);
# replay: calibrate, then bench_replay_gpu.py (default and cold replay vs do_bench and in situ);
# modes: bench_modes_gpu.py (eager vs compile vs cudagraph per module, whole-model compile);
# nproc: bench_nproc.py (torchrun --nproc 1 against in-process replay);
# probe-backward: probes/probe_backward.py (a train step's backward kernels in situ vs replayed, two
# backward timing methods, a failed capture's C++ stack; PROBE_SPEC a zoo spec relative to the repo,
# e.g. benchmarks/zoo.py:hf_llama, PROBE_FQNS space-separated); overhead: probes/probe_replay_overhead.py (replay wall in laps; cProfile too
# with OVERHEAD_CPROFILE=1; OVERHEAD_VARIANTS as FIDELITY_VARIANTS, e.g. "ci:converge_ci=0.01"); capture-probe: probes/probe_capture_step.py (a captured step's cost above
# the floor, by variant; PROBE_CASE); plan-call: probes/bench_plan_call.py (capture's planning alone, with
# and without another thread profiled); pinned: probes/bench_pinned_ring.py (the read-ahead ring's first
# pinned allocation, by way of allocating); digest: bench_state_digest.py on the GPU (whole
# vs sampled state digests); shards: probes/bench_shard_writes.py (capture's input writes by shard size
# and writer count, SHARD_CASES, SHARD_CONFIGS); memory: probes/probe_memory.py (GPU memory call by call in a train replay);
# fidelity: fidelity_zoo.py bf16 (per model: share of calls >= 10 us within 5 %, class medians, root,
# < 10 us median |error|; FIDELITY_MODELS comma-separated, FIDELITY_ARGS e.g. "--step train", "--no-context";
# FIDELITY_OUT names the output folder (brought back as FIDELITY_OUT.tgz) and log, for two runs in one call; FIDELITY_VARIANTS,
# space-separated NAME:KEY=VALUE[,KEY=VALUE], replays each capture again with those settings and
# compares call by call, e.g. "self:context_rewrite=self off:context_rewrite=off");
# train-set: fidelity_zoo.py --step train, one process a model (TRAIN_MODELS, TRAIN_TIMEOUT, FIDELITY_VARIANTS;
# PYTHONFAULTHANDLER on: an abort prints its Python stack);
# opportunity: bench_opportunity.py per model (the root and top 5 modules compiled in place, estimated vs
# measured saving; the replay's modes wall and out-of-memory rows; OPP_MODELS, OPP_MODES, OPP_ARGS
# e.g. --back-to-back-host-issue);
# compile-ahead: bench_compile_ahead.py (modes wall with compile workers 0 vs N, fresh caches each;
# AHEAD_MODELS, AHEAD_WORKERS);
# context-loads: probes/probe_context_loads.py (contexts' reads of the run, offered copies off vs on;
# CTX_SPECS);
# copies: probes/probe_input_copies.py (a call's rotating input copies made one by one vs at once);
# fresh: bench_replay_fresh.py (a plain `cbtrace replay` beside the replay inside `profile`; FRESH_MODELS,
# FRESH_REPEATS, FRESH_DTYPE);
# step-clock: probes/probe_step_clock.py (a call's kernels and the SM clock: a step after idle, a
# steady step, the call alone, after steps, after a flush; NanoGPT's GELU, or CLOCK_SPEC (a zoo
# spec relative to the repo, e.g. benchmarks/zoo.py:timm_convnext_tiny) and CLOCK_FQN); pos-conv: probes/probe_pos_conv.py
# (wav2vec2's grouped Conv1d: its kernels call by call, back to back, cudnn.benchmark);
# bn-train: probes/probe_bn_train_graph.py (a train-mode BatchNorm2d's kernels and gaps inside a graph);
# root-host: probes/probe_root_host.py (a root's host issue as the user runs it, beside a reader thread,
# after a profiler session, and in replay with the read-ahead on and off; ROOT_SPECS, zoo function names;
# ROOT_STEP=train);
# root-window: probes/probe_root_window.py (a host-paced root's back-to-back windows, plain and in
# replay: host a call, allocator retries, collections; WINDOW_SPECS, zoo function:step);
# mem-train: probes/probe_memory.py on ResNet-50 train (MEM_VARIANTS; the capture-room fix);
# engine-sums: probes/probe_engine_sums.py on the GPU (a leaf's engine adds, its own gradient
# sums, its in-situ backward with and without them, captured and plain step; SUMS_SPEC, SUMS_SIZE);
# insitu-repeat: probes/probe_insitu_repeat.py (the in-situ figure's own noise: one capture and
# replay, the plain step profiled REPEAT_STEPS times; REPEAT_MODELS, fidelity_zoo names);
# capture-failure: probes/probe_capture_failure.py (a train replay with --backward; each failed
# backward capture's C++ stack and what holds graphs reaching its parameters; FAIL_SPEC, FAIL_SIZE).
R=$PWD
source benchmarks/device_setup.sh >/dev/null || exit 1
cd /tmp
for WHAT in "$@"; do
case $WHAT in
tests)
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -c $R/pyproject.toml --rootdir $R ${TESTS_PATHS:-$R/tests} -m gpu -q -p no:cacheprovider 2>&1 | grep -v -E "^  |Warning:" | tee $OUT/gpu_tests.log | tail -12 ;;
profile)
  timeout ${PROFILE_TIMEOUT:-400} python3 $R/benchmarks/profile_models.py /tmp/prof ${PROFILE_MODELS:-nanogpt dlrm} 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/profile_models.log | tail -60
  cp /tmp/prof/*_modules.csv $OUT/ 2>/dev/null ;;
paper)
  timeout ${PAPER_TIMEOUT:-200} python3 $R/benchmarks/paper_demos.py /tmp/paper --models ${PAPER_MODELS:-dlrm,nanogpt} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/paper_demos.log | tail -40
  for f in /tmp/paper/*/icicle.html; do cp $f $OUT/icicle_$(basename $(dirname $f)).html; done ;;
capture)
  CBTRACE_BENCH_DIR=/tmp timeout ${CAPTURE_TIMEOUT:-200} python3 $R/benchmarks/bench_capture.py ${CAPTURE_MODELS:-} 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/bench_capture.log | tail -20 ;;
replay)
  timeout 60 python3 -m cbtrace calibrate --device cuda 2>&1 | tail -1
  timeout 540 python3 $R/benchmarks/bench_replay_gpu.py /tmp/runs nanogpt dlrm 2>&1 | grep -v -E "UserWarning|_warn_once|USDT" | tee $OUT/bench_replay.log | tail -80
  cp /tmp/runs/*_modules.csv $OUT/ 2>/dev/null ;;
modes)
  for M in ${MODES_MODELS:-nanogpt dlrm}; do
    timeout ${MODES_TIMEOUT:-300} python3 $R/benchmarks/bench_modes_gpu.py --out /tmp/modes --models $M ${MODES_DEPTH:+--max-depth $MODES_DEPTH} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/bench_modes_$M.log | tail -45
  done ;;
insitu-repeat)
  timeout ${REPEAT_TIMEOUT:-400} python3 $R/benchmarks/probes/probe_insitu_repeat.py /tmp/rep ${REPEAT_MODELS:-dcn resnet50 nanogpt} --steps ${REPEAT_STEPS:-5} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/insitu_repeat.log | tail -${REPEAT_LINES:-45} ;;
nproc)
  timeout ${NPROC_TIMEOUT:-150} python3 $R/benchmarks/bench_nproc.py /tmp/nproc 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/bench_nproc.log | tail -6 ;;
probe-backward)
  TORCH_SHOW_CPP_STACKTRACES=1 timeout ${PROBE_TIMEOUT:-200} python3 $R/benchmarks/probes/probe_backward.py /tmp/probe ${PROBE_SPEC:+$R/$PROBE_SPEC} ${PROBE_FQNS:-} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/probe_backward.log | tail -${PROBE_LINES:-40} ;;
memory)
  timeout ${MEMORY_TIMEOUT:-300} python3 $R/benchmarks/probes/probe_memory.py /tmp/pmem ${MEMORY_VARIANTS:-} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: |F.linear" | tee $OUT/probe_memory.log | tail -8 ;;
digest)
  timeout 200 python3 $R/benchmarks/bench_state_digest.py --device cuda ${DIGEST_MODELS:-dlrm dlrm:large nanogpt} 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/bench_state_digest.log | tail -5 ;;
pinned)
  timeout 120 python3 $R/benchmarks/probes/bench_pinned_ring.py 2>&1 | tee $OUT/bench_pinned_ring.log | tail -8 ;;
plan-call)
  timeout 120 python3 $R/benchmarks/probes/bench_plan_call.py 2>&1 | tee $OUT/bench_plan_call.log | tail -6 ;;
shards)
  for C in ${SHARD_CASES:-dlrm dlrm-large}; do
    CBTRACE_BENCH_DIR=/tmp timeout ${SHARD_TIMEOUT:-200} python3 $R/benchmarks/probes/bench_shard_writes.py --case $C ${SHARD_CONFIGS:+--configs $SHARD_CONFIGS} 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/bench_shard_writes_$C.log | tail -9
  done ;;
capture-probe)
  CBTRACE_BENCH_DIR=/tmp timeout ${PROBE_TIMEOUT:-200} python3 $R/benchmarks/probes/probe_capture_step.py ${PROBE_CASE:-} 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/probe_capture_step.log | tail -10 ;;
overhead)
  for M in ${OVERHEAD_MODELS:-nanogpt}; do
    timeout ${OVERHEAD_TIMEOUT:-150} python3 $R/benchmarks/probes/probe_replay_overhead.py /tmp/overhead $M --top 40 ${OVERHEAD_CPROFILE:+--cprofile} $(for V in ${OVERHEAD_VARIANTS:-}; do printf -- '--variant %s ' "$V"; done) 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " > $OUT/overhead_${M/:/_}.log
    head -${OVERHEAD_LINES:-30} $OUT/overhead_${M/:/_}.log
  done ;;
fidelity)
  timeout ${FIDELITY_TIMEOUT:-580} python3 $R/benchmarks/fidelity_zoo.py --out $OUT/${FIDELITY_OUT:-fidelity} --device cuda --dtype ${FIDELITY_DTYPE:-bf16} --models ${FIDELITY_MODELS:-nanogpt,dlrm,dcn,hstu,resnet50,efficientnet_b0,convnext_tiny,vit_b16,bert-base} ${FIDELITY_ARGS:-} $(for V in ${FIDELITY_VARIANTS:-}; do printf -- '--variant %s ' "$V"; done) 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/${FIDELITY_OUT:-fidelity}_zoo.log | tail -${FIDELITY_LINES:-60}
  # one archive: the device tool brings back only a few files a call
  tar czf $OUT/${FIDELITY_OUT:-fidelity}.tgz -C $OUT ${FIDELITY_OUT:-fidelity} && rm -rf $OUT/${FIDELITY_OUT:-fidelity} ;;
train-set)
  # one process a model: a crash (with its Python stack, faulthandler) loses that model alone
  TRAIN_DIRS=""
  for M in ${TRAIN_MODELS:-gpt2 llama t5-base mixtral fasterrcnn-train gnn compiled-gpt2}; do
    echo "=== $M"
    PYTHONFAULTHANDLER=1 timeout ${TRAIN_TIMEOUT:-150} python3 $R/benchmarks/fidelity_zoo.py --out $OUT/train_$M --device cuda --dtype ${FIDELITY_DTYPE:-bf16} --models $M --step train $(for V in ${FIDELITY_VARIANTS:-}; do printf -- '--variant %s ' "$V"; done) 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: |^frame #" > $OUT/train_${M}_zoo.log
    echo "exit ${PIPESTATUS[0]}" >> $OUT/train_${M}_zoo.log
    tail -${TRAIN_LINES:-12} $OUT/train_${M}_zoo.log
    [ -d $OUT/train_$M ] && TRAIN_DIRS="$TRAIN_DIRS train_$M"
  done
  [ -n "$TRAIN_DIRS" ] && tar czf $OUT/train_rows.tgz -C $OUT $TRAIN_DIRS && (cd $OUT && rm -rf $TRAIN_DIRS) ;;
opportunity)
  for M in ${OPP_MODELS:-efficientnet_b0 nanogpt dlrm}; do
    timeout ${OPP_TIMEOUT:-580} python3 $R/benchmarks/bench_opportunity.py --model $M --top 5 --modes ${OPP_MODES:-compile,cudagraph} ${OPP_ARGS:-} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/bench_opportunity_$M.log | tail -16
  done ;;
compile-ahead)
  for M in ${AHEAD_MODELS:-efficientnet_b0}; do
    timeout ${AHEAD_TIMEOUT:-580} python3 $R/benchmarks/bench_compile_ahead.py --model $M --workers ${AHEAD_WORKERS:-0,8} --out /tmp/ahead_$M 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/bench_compile_ahead_$M.log | tail -12
  done ;;
copies)
  timeout 120 python3 $R/benchmarks/probes/probe_input_copies.py --device cuda 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/probe_input_copies.log | tail -8 ;;
context-loads)
  timeout ${CTX_TIMEOUT:-300} python3 $R/benchmarks/probes/probe_context_loads.py /tmp/ctxloads ${CTX_SPECS:-dlrm:large nanogpt} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/probe_context_loads.log | tail -8 ;;
fresh)
  for M in ${FRESH_MODELS:-nanogpt dlrm:large}; do
    timeout ${FRESH_TIMEOUT:-300} python3 $R/benchmarks/bench_replay_fresh.py --model $M --device cuda ${FRESH_DTYPE:+--dtype $FRESH_DTYPE} --repeats ${FRESH_REPEATS:-2} 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/bench_replay_fresh_${M/:/_}.log | tail -30
  done ;;
capture-failure)
  TORCH_SHOW_CPP_STACKTRACES=1 timeout ${FAIL_TIMEOUT:-300} python3 $R/benchmarks/probes/probe_capture_failure.py /tmp/fail ${FAIL_SPEC:+$R/$FAIL_SPEC} --size ${FAIL_SIZE:-real} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: |^\[transformers\]" | tee $OUT/probe_capture_failure.log | tail -${FAIL_LINES:-80} ;;
engine-sums)
  timeout ${SUMS_TIMEOUT:-200} python3 $R/benchmarks/probes/probe_engine_sums.py /tmp/sums ${SUMS_SPEC:+$R/$SUMS_SPEC} --device cuda --dtype bf16 --size ${SUMS_SIZE:-real} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: |^\[transformers\]" | tee $OUT/probe_engine_sums.log | tail -${SUMS_LINES:-40} ;;
step-clock)
  timeout ${CLOCK_TIMEOUT:-120} python3 $R/benchmarks/probes/probe_step_clock.py ${CLOCK_SPEC:+$R/$CLOCK_SPEC} ${CLOCK_FQN:-} 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/probe_step_clock${CLOCK_FQN:+_$CLOCK_FQN}.log | tail -12 ;;
pos-conv)
  timeout ${POSCONV_TIMEOUT:-120} python3 $R/benchmarks/probes/probe_pos_conv.py 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/probe_pos_conv.log | tail -20 ;;
root-host)
  for F in ${ROOT_SPECS:-hf_bert timm_efficientnet_b0}; do
    timeout ${ROOT_TIMEOUT:-200} python3 $R/benchmarks/probes/probe_root_host.py /tmp/roothost_$F${ROOT_STEP:+_$ROOT_STEP} --spec $R/benchmarks/zoo.py:$F ${ROOT_STEP:+--step $ROOT_STEP} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/probe_root_host_$F${ROOT_STEP:+_$ROOT_STEP}.log | tail -18
  done ;;
root-window)
  for F in ${WINDOW_SPECS:-hf_llama:train hf_bert:forward}; do
    timeout ${WINDOW_TIMEOUT:-200} python3 $R/benchmarks/probes/probe_root_window.py /tmp/rootwin_${F/:/_} --spec $R/benchmarks/zoo.py:${F%%:*} --step ${F##*:} 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: " | tee $OUT/probe_root_window_${F/:/_}.log | tail -${WINDOW_LINES:-30}
  done ;;
mem-train)
  timeout ${MEM_TIMEOUT:-200} python3 $R/benchmarks/probes/probe_memory.py /tmp/pmem_train ${MEM_VARIANTS:-default} --spec $R/benchmarks/zoo.py:tv_resnet50 2>&1 | grep -v -E "USDT|Warn|warn|^cbtrace: |F.linear" | tee $OUT/probe_memory_resnet50.log | tail -6 ;;
bn-train)
  timeout ${BN_TIMEOUT:-120} python3 $R/benchmarks/probes/probe_bn_train_graph.py 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/probe_bn_train_graph.log | tail -20 ;;
esac
done
