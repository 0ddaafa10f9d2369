#!/usr/bin/env bash
# Device calls (sessions 2-3). Usage on the device machine, from the repo root:
#   bash benchmarks/gpu_session.sh tests|capture|replay [$OUT]   (several: run it once per word)
# tests: the GPU-marked tests; capture: capture overhead with its breakdown (bench_capture.py);
# replay: calibrate, then bench_replay_gpu.py (default and cold replay vs do_bench and in situ).
WHAT=$1; OUT=${2:-$OUT}; R=$PWD
source benchmarks/device_setup.sh >/dev/null || exit 1
cd /tmp
case $WHAT in
tests)
  timeout 300 python3 -m pytest -c $R/pyproject.toml --rootdir $R $R/tests -m gpu -q -p no:cacheprovider 2>&1 | grep -v -E "Warning|warn" | tail -8 ;;
capture)
  CBTRACE_BENCH_DIR=/tmp timeout 200 python3 $R/benchmarks/bench_capture.py 2>&1 | grep -v -E "USDT|Warn|warn" | tee $OUT/bench_capture.log | tail -8 ;;
replay)
  timeout 60 python3 -m cbtrace calibrate --device cuda 2>&1 | tail -1
  timeout 60 python3 $R/benchmarks/probe_clock.py 2>&1 | grep -v -E "Warn|warn" | tee $OUT/probe_clock.log
  timeout 540 python3 $R/benchmarks/bench_replay_gpu.py /tmp/runs nanogpt dlrm 2>&1 | grep -v -E "UserWarning|_warn_once|USDT" | tee $OUT/bench_replay.log | tail -80
  cp /tmp/runs/*_modules.csv $OUT/ 2>/dev/null
  for m in nanogpt dlrm; do
    (cd /tmp/runs/$m && tar czf $OUT/run_$m.tgz manifest.json modules.parquet do_bench.json *.pt.trace.json.gz 2>/dev/null)
  done ;;
esac
