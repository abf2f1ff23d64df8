#!/usr/bin/env bash
# GPU call 6: the committed trainer at 124M once more (attention chosen in the forward, NCCL device_id); hellaswag and generate parts.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 .gpu/make_shards.py /tmp/data 1 5000000 2>&1 | tail -1
T="--data_dir /tmp/data --log_dir /tmp/log --max_steps 4 --warmup_steps 2 --eval_interval 4 --val_steps 2 --hellaswag 0 --sample_interval 4 --checkpoint_interval 0"
echo "== python3 train_gpt2.py $T" | tee $OUT/trainer-124m-final.log
timeout 80 python3 train_gpt2.py $T 2>&1 | tee -a $OUT/trainer-124m-final.log; echo "exit $?" | tee -a $OUT/trainer-124m-final.log
echo "== python3 bench.py --parts hellaswag,generate --json bench/results/h100-hellaswag-generate.json" | tee $OUT/hellaswag-generate.log
timeout 150 python3 bench.py --parts hellaswag,generate --json $OUT/hellaswag-generate.json 2>&1 | grep -v Warn | tee -a $OUT/hellaswag-generate.log; echo "exit $?" | tee -a $OUT/hellaswag-generate.log
