#!/usr/bin/env bash
# What a GPU shows that the CPU tests cannot, in one run, each output under OUT/ (default
# bench/results/GPU-DATE/): the cuda tests, the peers, and the project's step profiled with the
# levers that await a measurement. PEERS holds checkouts of llm.c (with cudnn-frontend inside)
# and build-nanogpt (docs/benchmarks.md#peers-llmc-and-build-nanogpt-on-the-same-gpu).
#     PEERS=.peers bash bench/gpu.sh                 # all three (unmeasured: over 10 minutes)
#     PEERS=.peers bash bench/gpu.sh cuda-tests peers  # only those named
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PEERS=${PEERS:-.peers}
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())") || exit 1
OUT=${OUT:-bench/results/$gpu-$(date -u +%F)}
mkdir -p "$OUT"

parts=${*:-cuda-tests peers levers}
want() { [[ " $parts " == *" $1 "* ]]; }

run() {  # run NAME SECONDS COMMAND...: the command, its output and its exit code in OUT/NAME.log
    local name=$1 seconds=$2
    shift 2
    echo "== $* ($(date -u +%FT%TZ))" | tee "$OUT/$name.log"
    timeout "$seconds" "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
} > "$OUT/env.txt" 2>&1
want cuda-tests && run cuda-tests 240 python3 -m pytest -m cuda -p no:cacheprovider
want peers && run peers 420 python3 bench.py --parts peers --llmc "$PEERS/llm.c" --build_nanogpt "$PEERS/build-nanogpt" \
    --steps 10 --warmup 3 --json "$OUT/peers.json"
want levers && run levers 540 python3 bench.py --parts train --baseline 0 --profile --steps 10 --warmup 3 \
    --levers chunked_loss,cuda_graphs,coordinate_descent,cudnn_attention --json "$OUT/levers.json"
