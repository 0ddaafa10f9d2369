#!/usr/bin/env bash
# Final device call: GPU tests, capture overhead with its breakdown, replay + error tables.
OUT=${1:-/tmp/out}; R=$PWD
source benchmarks/device_setup.sh || exit 1
cd /tmp
timeout 60 python3 -m cbtrace calibrate --device cuda 2>&1 | tail -1
timeout 180 python3 -m pytest -c $R/pyproject.toml --rootdir $R $R/tests -m gpu -q -p no:cacheprovider 2>&1 | grep -v -E "Warning|warn" | tail -6
CBTRACE_BENCH_DIR=/tmp timeout 100 python3 $R/benchmarks/bench_capture.py 2>&1 | grep -v -E "USDT|Warn|warn" | tail -4
rm -rf /tmp/capt && timeout 100 python3 -m cbtrace capture --model nanogpt --dtype bf16 --device cuda --out /tmp/capt >/dev/null 2>&1
rm -rf /tmp/capt2 && timeout 100 python3 -m cbtrace capture --model nanogpt --dtype bf16 --device cuda --out /tmp/capt2 >/dev/null 2>&1
python3 -c "import json; m=json.load(open('/tmp/capt2/manifest.json')); print('capture timings (2nd run)', {k: round(v,3) for k,v in m['capture_timings_s'].items()})"
timeout 330 python3 $R/benchmarks/bench_replay_gpu.py /tmp/runs nanogpt dlrm 2>&1 | grep -v -E "UserWarning|_warn_once|USDT" | tee $OUT/bench_replay.log | tail -70
for m in nanogpt dlrm; do (cd /tmp/runs/$m && tar czf $OUT/run_$m.tgz manifest.json modules.parquet do_bench.json *.pt.trace.json.gz); done
