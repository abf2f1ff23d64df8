#!/usr/bin/env bash
# What a GPU shows that the CPU tests cannot, as one job of at most 8 minutes, in order of value:
# the probe and the peers (the project's default beside build-nanogpt and each llm.c configuration),
# the project's step against the masked loss and at -B 128, the cuda tests; then, if time is left,
# CUDA graphs and the profile of the default step. Each command runs under `timeout`, never past
# BUDGET seconds from the start, kills included; tests/test_bench.py checks the budget and that at
# most 8 files are written, into OUT (default bench/results/GPU-DATE/). PEERS holds llm.c (with
# cudnn-frontend's include/ inside) and build-nanogpt, as git archive trees
# (docs/benchmarks.md#peers-llmc-and-build-nanogpt-on-the-same-gpu).
#     PEERS=.peers bash bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PEERS=${PEERS:-.peers}
BUDGET=480      # seconds for the whole job
KILL_AFTER=5    # seconds from a command's timeout to its SIGKILL, if SIGTERM did not end it
# The timed runs: steps after the warm-up (compilation), and the warm-up, bench.py's --steps and --warmup.
STEPS="--steps 6 --warmup 2"

run() {  # run NAME SECONDS COMMAND...: at most SECONDS, and never past BUDGET; output and exit code in OUT/NAME.log
    local name=$1 want=$2 left=$((BUDGET - SECONDS - KILL_AFTER))
    local seconds=$((want < left ? want : left))
    shift 2
    if ((seconds < want && seconds < 30)); then  # too little left to be worth starting
        echo "== skipped, ${left} s of the budget left: $*" | tee -a "$OUT/$name.log"
        return
    fi
    echo "== $* ($(date -u +%FT%TZ), at most ${seconds} s)" | tee -a "$OUT/$name.log"
    timeout -k "$KILL_AFTER" "$seconds" "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "exit ${PIPESTATUS[0]} at ${SECONDS} s" | tee -a "$OUT/$name.log"
}

job() {  # the first four get their whole time: 440 s and 4 kills, within BUDGET
    run peers 15 python3 peers.py
    run peers 240 python3 bench.py --parts peers --llmc "$PEERS/llm.c" --build_nanogpt "$PEERS/build-nanogpt" \
        $STEPS --peer_timeout 100 --json "$OUT/peers.json"
    run levers 110 python3 bench.py --parts train --baseline 0 -B 64,128 $STEPS --levers masked_loss \
        --json "$OUT/levers.json"
    run cuda-tests 75 python3 -m pytest -m cuda -p no:cacheprovider -o addopts= -v -rA --durations=0
    # If time is left:
    run levers 80 python3 bench.py --parts train --baseline 0 $STEPS --levers cuda_graphs --json "$OUT/graphs.json"
    run levers 70 python3 bench.py --parts train --baseline 0 --profile --steps 1 --warmup 2 --json "$OUT/profile.json"
}

gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())") || exit 1
OUT=${OUT:-bench/results/$gpu-$(date -u +%F)}
mkdir -p "$OUT"
job  # SECONDS, bash's own, counts from the script's start
