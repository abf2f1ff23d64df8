#!/usr/bin/env bash
# GPU call 1: the trainer's CUDA paths (bf16, compile, fused AdamW, SIGTERM checkpoint, resume), then bench train at 124M.
set -o pipefail
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import torch,sys;print('torch', torch.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name())"; } 2>&1 | tee $OUT/env.txt
python3 .gpu/make_shards.py /tmp/data 2 10000000 2>&1 | tail -1
T="--data_dir /tmp/data --log_dir /tmp/log --max_steps 20 --warmup_steps 10 --eval_interval 10 --val_steps 5 --hellaswag 0 --sample_interval 10 --checkpoint_interval 10"
echo "== python3 train_gpt2.py $T --fault sigterm@12" | tee $OUT/train124m.log
timeout 200 python3 train_gpt2.py $T --fault sigterm@12 2>&1 | tee -a $OUT/train124m.log; echo "exit $?" | tee -a $OUT/train124m.log
echo "== python3 train_gpt2.py $T --resume auto" | tee -a $OUT/train124m.log
timeout 150 python3 train_gpt2.py $T --resume auto 2>&1 | tee -a $OUT/train124m.log; echo "exit $?" | tee -a $OUT/train124m.log
cp /tmp/log/log.jsonl $OUT/train124m-log.jsonl
echo "== python3 bench.py --parts matmul,train --json bench/results/h100-train.json" | tee $OUT/bench-train.log
timeout 230 python3 bench.py --parts matmul,train --json $OUT/h100-train.json 2>&1 | tee -a $OUT/bench-train.log; echo "exit $?" | tee -a $OUT/bench-train.log
