#!/usr/bin/env bash
# What a GPU shows that the CPU tests cannot, in parts that each run as one job of under 10
# minutes: a part's timeouts (each with its KILL_AFTER) add up to at most 540 s, and it writes at
# most 8 files, none over 16 MiB (tests/test_bench.py checks the first two), into OUT/ (default
# bench/results/GPU-DATE/). PEERS holds llm.c (cudnn-frontend's include/ inside) and build-nanogpt
# (docs/benchmarks.md#peers-llmc-and-build-nanogpt-on-the-same-gpu).
#     PEERS=.peers bash bench/gpu.sh part1   # the probe, the peers, the project's step profiled
#     bash bench/gpu.sh part2                # the cuda tests, the loss variants, cuDNN attention
#     bash bench/gpu.sh part3                # optional: micro-batch 128, the slow levers
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PEERS=${PEERS:-.peers}
KILL_AFTER=5  # seconds from a job's timeout to its SIGKILL, if SIGTERM did not end it
# The loss variants timed beside the project's default on CUDA, the fused loss: bench.py's lever names.
LOSS_VARIANTS=masked_loss,chunked_loss

run() {  # run NAME SECONDS COMMAND...: the command, its output and its exit code in OUT/NAME.log
    local name=$1 seconds=$2
    shift 2
    echo "== $* ($(date -u +%FT%TZ))" | tee "$OUT/$name.log"
    timeout -k "$KILL_AFTER" "$seconds" "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
}

part1() {
    run probe 20 python3 peers.py
    run peers 330 python3 bench.py --parts peers --llmc "$PEERS/llm.c" --build_nanogpt "$PEERS/build-nanogpt" \
        --steps 10 --warmup 3 --peer_timeout 150 --json "$OUT/peers.json"
    run profile 175 python3 bench.py --parts train --baseline 0 --profile --steps 3 --warmup 2 --json "$OUT/profile.json"
}

part2() {
    run cuda-tests 200 python3 -m pytest -m cuda -p no:cacheprovider -o addopts= -v -rA --durations=0
    run levers 325 python3 bench.py --parts train --baseline 0 --steps 10 --warmup 3 \
        --levers "$LOSS_VARIANTS,cudnn_attention" --json "$OUT/levers.json"
}

part3() {
    run batch128 150 python3 bench.py --parts train --baseline 0 -B 128 --steps 10 --warmup 3 --json "$OUT/batch128.json"
    run slow-levers 380 python3 bench.py --parts train --baseline 0 --steps 10 --warmup 3 \
        --levers cuda_graphs,coordinate_descent --json "$OUT/slow-levers.json"
}

case ${1:-} in
    part1 | part2 | part3) ;;
    *) echo "usage: bash bench/gpu.sh part1|part2|part3 (one part per job)" >&2; exit 2 ;;
esac
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())") || exit 1
OUT=${OUT:-bench/results/$gpu-$(date -u +%F)}
mkdir -p "$OUT"
"$1"
