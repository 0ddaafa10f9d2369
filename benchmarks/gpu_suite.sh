#!/usr/bin/env bash
# One device call: calibrate, replay benchmark (NanoGPT + DLRM) vs do_bench, capture overhead.
# Usage on the device machine, from the repo root:  bash benchmarks/gpu_suite.sh $OUT
OUT=${1:-/tmp/out}; R=$PWD
source benchmarks/device_setup.sh || exit 1
cd /tmp
timeout 60 python3 -m cbtrace calibrate --device cuda 2>&1 | tail -8
timeout 420 python3 $R/benchmarks/bench_replay_gpu.py /tmp/runs nanogpt dlrm 2>&1 | grep -v -E "UserWarning|_warn_once|USDT" | tee $OUT/bench_replay.log | tail -90
for m in nanogpt dlrm; do
  (cd /tmp/runs/$m && tar czf $OUT/run_$m.tgz manifest.json modules.parquet do_bench.json 2>/dev/null)
done
cp /tmp/runs/nanogpt/*.pt.trace.json.gz $OUT/ 2>/dev/null
CBTRACE_BENCH_DIR=/tmp timeout 90 python3 $R/benchmarks/bench_capture.py 2>&1 | grep -v USDT | tail -6
