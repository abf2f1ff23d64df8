#!/bin/bash
# The measurement of bench/results/muon-cpu-2core/README.md: the demo model on Tiny Shakespeare,
# 300 steps, AdamW at three peak lrs against Muon at three peak lrs (AdamW at 2e-3 for the rest),
# two runs at a time, one thread each, on a 2-core CPU. Run from the repository root.
set -e
OUT=bench/results/muon-cpu-2core
COMMON="--preset demo --max_steps 300 --eval_interval 100 --val_steps 16 --hellaswag 0 --sample_interval 0"
run() {  # name, flags...
  local name=$1; shift
  OMP_NUM_THREADS=1 python train_gpt2.py $COMMON --log_dir /tmp/muon-bench/$name "$@" > $OUT/$name.log 2>&1
  cp /tmp/muon-bench/$name/log.jsonl $OUT/$name.jsonl
}
# The demo shards Tiny Shakespeare on first use: once, here, before two runs would race to do it.
python train_gpt2.py --preset demo --max_steps 0 --hellaswag 0 --sample_interval 0 --log_dir /tmp/muon-bench/shard > /dev/null
run adamw-1e-3 --max_lr 1e-3 & run adamw-2e-3 --max_lr 2e-3 & wait
run adamw-4e-3 --max_lr 4e-3 & run muon-0.01 --max_lr 2e-3 --optimizer muon --muon_lr 0.01 & wait
run muon-0.02 --max_lr 2e-3 --optimizer muon --muon_lr 0.02 & run muon-0.04 --max_lr 2e-3 --optimizer muon --muon_lr 0.04 & wait
