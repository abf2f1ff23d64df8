#!/usr/bin/env bash
# GPU call 5: which attention kernel runs for each --attention, compiled and eager; then max-autotune at 124M.
set -o pipefail
export PYTHONUNBUFFERED=1
timeout 150 python3 .gpu/attn_check.py 2>&1 | grep -v Warning | tee $OUT/attention-kernels.log
python3 .gpu/make_shards.py /tmp/data 1 2000000 2>&1 | tail -1
B="--parts train --baseline 0 --levers max_autotune"
echo "== python3 bench.py $B --json bench/results/h100-max-autotune.json" | tee $OUT/bench-max-autotune.log
timeout 400 python3 bench.py $B --json $OUT/h100-max-autotune.json 2>&1 | tee -a $OUT/bench-max-autotune.log; echo "exit $?" | tee -a $OUT/bench-max-autotune.log
