#!/bin/bash
# The measurement of bench/results/muon-cpu-2core/README.md, from the repository root: AdamW against
# Muon (--optimizer muon, with q, k and v orthogonalized apart, and qkv_whole.py, with c_attn as one
# matrix) on the demo model and on one size larger, 300 steps of 1,024 tokens of Tiny Shakespeare
# each, a learning rate sweep per optimizer; then Muon's momentum and weight decay, and a second seed.
# Two runs at a time, one thread each, on a 2-core CPU. A run whose SIZE/NAME.jsonl is here is skipped.
set -e
OUT=bench/results/muon-cpu-2core
COMMON="--preset demo --max_steps 300 --eval_interval 100 --val_steps 16 --hellaswag 0 --sample_interval 0"
size_flags() { [ $1 = 6x192 ] && echo "--n_layer 6 --n_head 6 --n_embd 192"; true; }  # demo: the preset's
run() {  # size name script flags...
  local size=$1 name=$2 script=$3; shift 3
  [ -e $OUT/$size/$name.jsonl ] && return
  mkdir -p $OUT/$size
  OMP_NUM_THREADS=1 python $script $COMMON $(size_flags $size) --log_dir /tmp/muon-bench/$size-$name "$@" > $OUT/$size/$name.log 2>&1
  cp /tmp/muon-bench/$size-$name/log.jsonl $OUT/$size/$name.jsonl
}
runs() {  # every run, one a line: size name script flags...
  for size in demo 6x192; do
    adamw_lrs="1e-3 2e-3 4e-3"
    [ $size = 6x192 ] && adamw_lrs="5e-4 $adamw_lrs"  # 1e-3 was its best of the other three
    for lr in $adamw_lrs; do echo $size adamw-$lr train_gpt2.py --max_lr $lr; done
    for lr in 0.005 0.01 0.02 0.04; do
      echo $size muon-apart-$lr train_gpt2.py --optimizer muon --muon_lr $lr
      echo $size muon-whole-$lr $OUT/qkv_whole.py --optimizer muon --muon_lr $lr
    done
  done
  for momentum in 0.9 0.98; do
    echo demo muon-apart-0.02-momentum-$momentum train_gpt2.py --optimizer muon --muon_lr 0.02 --muon_momentum $momentum
  done
  for decay in 0 0.3; do
    echo demo muon-apart-0.02-decay-$decay train_gpt2.py --optimizer muon --muon_lr 0.02 --muon_weight_decay $decay
  done
  echo 6x192 muon-apart-0.02-momentum-0.9 train_gpt2.py --optimizer muon --muon_lr 0.02 --muon_momentum 0.9
  # Another seed (init and data order): how far apart two runs of one setting land.
  echo demo muon-apart-0.02-seed-1 train_gpt2.py --optimizer muon --muon_lr 0.02 --seed 1
  echo demo muon-whole-0.02-seed-1 $OUT/qkv_whole.py --optimizer muon --muon_lr 0.02 --seed 1
}
export -f run size_flags; export OUT COMMON
# The demo shards Tiny Shakespeare on first use: once, here, before two runs would race to do it.
python train_gpt2.py --preset demo --max_steps 0 --hellaswag 0 --sample_interval 0 --log_dir /tmp/muon-bench/shard > /dev/null
runs | xargs -P 2 -L 1 bash -c 'run "$@"' _
