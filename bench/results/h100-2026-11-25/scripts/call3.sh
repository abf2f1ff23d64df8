#!/usr/bin/env bash
# GPU call 3: GPT-2 XL under FSDP2 on one GPU (torchrun), recompute full, compiled blocks, async sharded checkpoint; --plan beside it.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 .gpu/make_shards.py /tmp/data 2 10000000 2>&1 | tail -1
X="--preset gpt2-xl --fsdp 1 --recompute full -B 8 --total_batch_size 65536 --max_steps 20 --eval_interval 0 --sample_interval 0 --async_checkpoint --data_dir /tmp/data --log_dir /tmp/logxl"
echo "== python3 train_gpt2.py $X --plan --plan_world_size 1" | tee $OUT/fsdp-xl.log
python3 train_gpt2.py $X --plan --plan_world_size 1 2>&1 | tee -a $OUT/fsdp-xl.log
echo "== torchrun --standalone --nproc_per_node=1 train_gpt2.py $X" | tee -a $OUT/fsdp-xl.log
timeout 420 torchrun --standalone --nproc_per_node=1 train_gpt2.py $X 2>&1 | tee -a $OUT/fsdp-xl.log; echo "exit $?" | tee -a $OUT/fsdp-xl.log
ls -la /tmp/logxl /tmp/logxl/ckpt_* 2>&1 | head -20 | tee -a $OUT/fsdp-xl.log; du -sh /tmp/logxl/ckpt_* | tee -a $OUT/fsdp-xl.log
cp /tmp/logxl/log.jsonl $OUT/fsdp-xl-log.jsonl
