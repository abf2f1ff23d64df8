#!/usr/bin/env bash
# GPU call 2: the trainer's CUDA paths at 124M (bf16, compile, fused AdamW, SIGTERM checkpoint, resume into fused AdamW); bench's memory levers at GPT-2 XL's shape.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 .gpu/make_shards.py /tmp/data 2 10000000 2>&1 | tail -1
T="--data_dir /tmp/data --log_dir /tmp/log --max_steps 20 --warmup_steps 10 --eval_interval 10 --val_steps 5 --hellaswag 0 --sample_interval 10 --checkpoint_interval 10"
echo "== python3 train_gpt2.py $T --fault sigterm@12" | tee $OUT/train124m.log
timeout 170 python3 train_gpt2.py $T --fault sigterm@12 2>&1 | tee -a $OUT/train124m.log; echo "exit $?" | tee -a $OUT/train124m.log
echo "== python3 train_gpt2.py $T --resume auto" | tee -a $OUT/train124m.log
timeout 130 python3 train_gpt2.py $T --resume auto 2>&1 | tee -a $OUT/train124m.log; echo "exit $?" | tee -a $OUT/train124m.log
cp /tmp/log/log.jsonl $OUT/train124m-log.jsonl
B="--parts train --baseline 0 --compile 0 --n_layer 48 --n_head 25 --n_embd 1600 -B 4 --steps 10 --warmup 3 --levers chunked_loss,recompute_full,recompute_attn,recompute_core_attn"
echo "== python3 bench.py $B --json bench/results/h100-xl-memory.json" | tee $OUT/bench-xl-memory.log
timeout 270 python3 bench.py $B --json $OUT/h100-xl-memory.json 2>&1 | tee -a $OUT/bench-xl-memory.log; echo "exit $?" | tee -a $OUT/bench-xl-memory.log
