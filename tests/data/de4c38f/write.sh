#!/usr/bin/env bash
# Writes this directory's checkpoints and resumed.json with the code of commit de4c38f (a clone of
# the repository at that commit: REPO), on 2 CPU cores: bash tests/data/de4c38f/write.sh REPO
set -euo pipefail
REPO=$(cd "$1" && pwd); HERE=$(cd "$(dirname "$0")" && pwd)
[ "$(git -C "$REPO" rev-parse --short=7 HEAD)" = de4c38f ] || { echo "$REPO is not at de4c38f"; exit 1; }
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
cd "$REPO"
python -c "import sys; sys.path.insert(0, 'tests'); from helpers import write_token_shards; write_token_shards('$W/data')"
# tests/helpers.py's TINY, narrower (16 wide, a context of 32): each file is tens of KB
FLAGS=$(python -c "import sys; sys.path.insert(0, 'tests'); from helpers import TINY; print(' '.join(TINY))")
FLAGS="$FLAGS --n_embd 16 --block_size 32 --total_batch_size 256 -B 4 --eval_interval 2 --val_steps 1 --data_dir $W/data"
TORCHRUN="python -m torch.distributed.run --standalone --nproc_per_node=2"
declare -A RUN=([adamw]="--dropout 0.1" [muon]="--optimizer muon" [adamw_fsdp]="--dropout 0.1 --fsdp 1"
                [muon_fsdp]="--optimizer muon --fsdp 1")
rm -rf "$HERE"/adamw "$HERE"/muon "$HERE"/adamw_fsdp "$HERE"/muon_fsdp
for name in adamw muon adamw_fsdp muon_fsdp; do  # 2 steps, checkpointed at the end
    launch=python; [[ $name == *_fsdp ]] && launch=$TORCHRUN
    $launch train_gpt2.py $FLAGS ${RUN[$name]} --max_steps 2 --log_dir "$W/$name" > "$W/$name.out" 2>&1
    mkdir -p "$HERE/$name"; cp -r "$W/$name"/ckpt_000002* "$HERE/$name/"
done
# Each resumed to step 4: in one process, and (sharded, and the one-file Muon) under FSDP on 2 ranks
resume() {  # NAME CHECKPOINT LAUNCH FLAGS...
    local name=$1 ckpt=$2 launch=$3; shift 3
    $launch train_gpt2.py $FLAGS "$@" --max_steps 4 --resume "$HERE/$ckpt" --log_dir "$W/resumed_$name" > "$W/resumed_$name.out" 2>&1
}
resume adamw adamw/ckpt_000002.pt python --dropout 0.1
resume muon muon/ckpt_000002.pt python --optimizer muon
resume adamw_fsdp adamw_fsdp/ckpt_000002 "$TORCHRUN" --dropout 0.1 --fsdp 1
resume muon_fsdp muon_fsdp/ckpt_000002 "$TORCHRUN" --optimizer muon --fsdp 1
resume adamw_fsdp_in_one adamw_fsdp/ckpt_000002 python --dropout 0.1
resume muon_fsdp_in_one muon_fsdp/ckpt_000002 python --optimizer muon
resume muon_in_fsdp muon/ckpt_000002.pt "$TORCHRUN" --optimizer muon --fsdp 1
python - "$W" "$HERE/resumed.json" <<'PY'
import glob, json, os, sys
work, out = sys.argv[1:]
keys = ("train_loss", "grad_norm", "val_loss")
runs = {}
for log in sorted(glob.glob(os.path.join(work, "resumed_*", "log.jsonl"))):
    records = [json.loads(line) for line in open(log)]
    runs[os.path.basename(os.path.dirname(log))[len("resumed_"):]] = [
        {"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in records if any(k in r for k in keys)]
with open(out, "w") as f:
    json.dump(runs, f, indent=1)
    f.write("\n")
PY
