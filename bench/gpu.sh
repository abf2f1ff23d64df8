#!/usr/bin/env bash
# What a GPU shows that the CPU tests cannot, as one job of at most 8 minutes, its parts in the order
# of what each proves (docs/benchmarks.md#on-a-gpu-benchgpush-one-job):
#   probe       what the peers need of the machine, and the device's two ceilings (matmul, copy)
#   cuda-tests  the proof that the default is right on a GPU: every loss, eager and compiled, against float32
#   default     the default step against the masked loss, at -B 64 and 128
#   profile     where the default step's time goes, each category beside its floor
#   peers       the project beside build-nanogpt and each llm.c configuration (-ge included)
#   levers      the other levers: +max_autotune, +coordinate_descent, +cuda_graphs
# Each command runs under `timeout`, never past BUDGET seconds from the start, kills included; a part
# the budget cut is named at the end, for a second call to run by name:
#     PEERS=.peers bash bench/gpu.sh              # every part, in this order
#     PEERS=.peers bash bench/gpu.sh peers levers # only those (in the job's order)
# tests/test_bench.py checks the order, the budget and that at most 8 files are written, into OUT
# (default bench/results/GPU-DATE/). PEERS holds llm.c (with cudnn-frontend's include/ inside) and
# build-nanogpt, as git archive trees (docs/benchmarks.md#peers-llmc-and-build-nanogpt-on-the-same-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PEERS=${PEERS:-.peers}
BUDGET=480      # seconds for the whole job
KILL_AFTER=5    # seconds from a command's timeout to its SIGKILL, if SIGTERM did not end it
PARTS=(probe cuda-tests default profile peers levers)
# The timed runs: steps after the warm-up (compilation), and the warm-up, bench.py's --steps and --warmup.
STEPS="--steps 6 --warmup 2"
CUT=()  # the parts the budget cut: a command skipped or stopped by its timeout

run() {  # run LOG SECONDS COMMAND...: at most SECONDS, and never past BUDGET; output and exit code in OUT/LOG.log
    local name=$1 want=$2 left=$((BUDGET - SECONDS - KILL_AFTER))
    local seconds=$((want < left ? want : left))
    shift 2
    if ((seconds < want && seconds < 30)); then  # too little left to be worth starting
        echo "== skipped, ${left} s of the budget left: $*" | tee -a "$OUT/$name.log"
        CUT+=("$PART")
        return
    fi
    echo "== $* ($(date -u +%FT%TZ), at most ${seconds} s)" | tee -a "$OUT/$name.log"
    timeout -k "$KILL_AFTER" "$seconds" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local code=${PIPESTATUS[0]}
    echo "exit $code at ${SECONDS} s" | tee -a "$OUT/$name.log"
    if ((code == 124 || code == 137)); then  # timeout's: stopped, or killed after it
        CUT+=("$PART")
    fi
}

part() {  # part NAME: its commands, each under run; the first four get their whole time within BUDGET
    PART=$1
    case $1 in
    probe)
        run probe 10 python3 -m gpt2repro.benchmark.peers
        run probe 30 python3 bench.py --parts matmul ;;
    cuda-tests)
        run cuda-tests 120 python3 -m pytest -m cuda -p no:cacheprovider -o addopts= -v -rA --durations=0 ;;
    default)
        run bench 170 python3 bench.py --parts train --baseline 0 -B 64,128 $STEPS --levers masked_loss \
            --json "$OUT/default.json" ;;
    profile)
        run bench 120 python3 bench.py --parts train --baseline 0 --profile --steps 1 --warmup 2 \
            --json "$OUT/profile.json" ;;
    peers)
        run bench 330 python3 bench.py --parts peers --llmc "$PEERS/llm.c" --build_nanogpt "$PEERS/build-nanogpt" \
            $STEPS --peer_timeout 100 --json "$OUT/peers.json" ;;
    levers)
        run bench 400 python3 bench.py --parts train --baseline 0 $STEPS \
            --levers max_autotune,coordinate_descent,cuda_graphs --json "$OUT/levers.json" ;;
    esac
}

asked=("$@")
for name in "${asked[@]}"; do
    if [[ " ${PARTS[*]} " != *" $name "* ]]; then
        echo "bench/gpu.sh: no part named '$name': the parts are ${PARTS[*]}" >&2
        exit 2
    fi
done
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())") || exit 1
OUT=${OUT:-bench/results/$gpu-$(date -u +%F)}
mkdir -p "$OUT"
for name in "${PARTS[@]}"; do  # SECONDS, bash's own, counts from the script's start
    if ((${#asked[@]} == 0)) || [[ " ${asked[*]} " == *" $name "* ]]; then
        part "$name"
    fi
done
if ((${#CUT[@]})); then
    cut=$(printf '%s\n' "${CUT[@]}" | uniq | tr '\n' ' ')
    echo "== cut by the budget: ${cut% }; run what is left in a second call: PEERS=$PEERS bash bench/gpu.sh ${cut% }"
fi
