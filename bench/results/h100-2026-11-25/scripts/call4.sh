#!/usr/bin/env bash
# GPU call 4: bench's training levers at GPT-2 (124M), B=64 (max-autotune apart); a tiny 1-rank torchrun run (NCCL's device binding).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 .gpu/make_shards.py /tmp/data 1 2000000 2>&1 | tail -1
timeout 60 torchrun --standalone --nproc_per_node=1 train_gpt2.py --n_layer 2 --n_head 2 --n_embd 64 -B 4 -T 256 --total_batch_size 1024 --max_steps 3 --eval_interval 0 --sample_interval 0 --data_dir /tmp/data --log_dir /tmp/tiny 2>&1 | tee $OUT/torchrun-tiny.log | grep -v "^step"
B="--parts train --baseline 0 --levers compile,fused_adamw,padded_vocab,flash_attention,cudnn_attention"
echo "== python3 bench.py $B --json bench/results/h100-levers.json" | tee $OUT/bench-levers.log
timeout 440 python3 bench.py $B --json $OUT/h100-levers.json 2>&1 | tee -a $OUT/bench-levers.log; echo "exit $?" | tee -a $OUT/bench-levers.log
