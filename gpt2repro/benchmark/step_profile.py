"""Where a training step's time goes, and how far each part of it is from the least time the
hardware allows: the profiler's events summed by category (bench.py --profile runs the steps),
and each category's floor, its work counted from the model's shapes (FLOPs for the matmuls and
attention, bytes for the rest) at the device's two ceilings measured in the same run (its dense
matmul rate, its copy bandwidth).
"""
import gzip
import os
import re
import shutil
import tempfile

import torch

from gpt2repro.common.atomic import atomic_open
from model import n_params

# The categories, from the names of the operators (aten::..., on the CPU) and of the device's
# kernels (on CUDA): the first whose pattern (a regular expression, searched for, case ignored) is found
# in the name wins. Attention comes before matmul: flash and memory-efficient kernels are CUTLASS
# GEMMs too. The math attention is its parts (bmm: matmul, softmax: element-wise). On the CPU an
# operator that is element-wise by its own name takes the category of the nearest operator or
# annotation around it that has one: AdamW's mul_ and lerp_ inside Optimizer.step are the optimizer's.
PROFILE_CATEGORIES = (
    ("attention", r"scaled_dot_product|attention|flash|sdpa|fmha"),
    ("matmul", r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addmv|mv|dot)$|gemm|cutlass|xmma|nvjet|triton_tem"),
    ("normalization", r"layer_norm|layernorm|GammaBeta"),
    ("loss", r"cross_entropy|log_?softmax|nll_loss"),
    ("optimizer", r"adam|_foreach_|multi_tensor_apply|lpnorm|Optimizer\.step"),
    ("copies", r"memcpy|^aten::(copy_|_to_copy|to|pin_memory|_pin_memory)$|direct_copy_kernel"),
    ("element-wise", r""),  # everything else: gelu, add, mul, embedding, fused Triton kernels...
)
PROFILE_IDLE = {  # what the idle row is, by where the step ran
    "cpu": "the steps' wall time outside every aten operator's self time: Python, the autograd engine, the "
           "data loader, the profiler's own bookkeeping",
    "cuda": "the steps' wall time in which no kernel or copy ran on the GPU (the kernels' times summed, "
            "as if on one stream)"}
FLOPS, BYTES = "FLOPs", "bytes"  # the two kinds of work: at the matmul rate, at the copy bandwidth


def profile_category(name):
    """The category of an operator's or kernel's name: the first of PROFILE_CATEGORIES that matches."""
    return next(category for category, pattern in PROFILE_CATEGORIES if re.search(pattern, name, re.IGNORECASE))


def operator_category(event):
    """The category of a CPU event: its name's, or where that is element-wise, that of the nearest
    event around it whose name has another (see PROFILE_CATEGORIES)."""
    while event is not None:
        category = profile_category(event.name)
        if category != "element-wise":
            return category
        event = event.cpu_parent
    return "element-wise"


def export_trace(prof, path):
    """Writes prof's Chrome trace to path, gzipped, whole or not at all; returns why it could not,
    or None. torch writes NAME.tmp and renames it, following a link planted there, and on a failed
    write (a full disk) only logs it, leaving NAME.tmp and no trace: it writes in a folder of this
    process's own beside path (mkdtemp: a random name, made exclusively, that no one else may
    write in), whose gzipped copy is renamed to path once it is whole."""
    try:
        folder = tempfile.mkdtemp(prefix=f"{os.path.basename(path)}.", suffix=".partial",
                                  dir=os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        return e.strerror or str(e)
    partial = os.path.join(folder, "trace.json")
    try:
        prof.export_chrome_trace(partial)
        if not os.path.isfile(partial):
            return "torch's export wrote nothing (a full disk?)"
        with open(partial, "rb") as trace, atomic_open(path) as f, gzip.GzipFile(fileobj=f, mode="wb") as compressed:
            shutil.copyfileobj(trace, compressed)
        return None
    except OSError as e:
        return e.strerror or str(e)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def profile_table(events, seconds, n_steps, device_type):
    """Milliseconds per step and share of the step of each category, and idle, from the profiler's
    events (prof.events()), counting self time only so that nothing nested is counted twice: on
    CUDA the device's kernels and copies (self_device_time_total; the operators that launched them are
    not counted again, nor record_function's spans on the GPU's timeline, as torch's own table sums
    them), by their names; elsewhere the aten operators (self_cpu_time_total; the
    autograd engine's and record_function's wrappers are not operators), by operator_category.
    Shares are of the steps' wall time, or of the categories' sum where that is longer (streams that
    overlap): they add up to 100 with idle."""
    on_device = device_type == "cuda"
    micros = dict.fromkeys([category for category, _ in PROFILE_CATEGORIES], 0.0)
    for e in events:
        if on_device and e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation:
            micros[profile_category(e.name)] += e.self_device_time_total
        elif not on_device and e.name.startswith("aten::"):
            micros[operator_category(e)] += e.self_cpu_time_total
    wall = 1e6 * seconds
    whole = max(wall, sum(micros.values()))
    micros["idle"] = whole - sum(micros.values())
    rows = [dict(category=category, ms_per_step=us / 1000 / n_steps, share=100 * us / whole)
            for category, us in micros.items()]
    return dict(wall_ms_per_step=wall / 1000 / n_steps, rows=rows,
                idle_means=PROFILE_IDLE["cuda" if on_device else "cpu"])


# ----------------------------------------------------------------------------- the floors

def step_work(config, tokens, activation_bytes):
    """{category: (FLOPS or BYTES, how many)}: the least work of one optimizer step of tokens tokens
    through a GPT of config (its block_size the sequence length T), what no implementation can do
    without. Activations are activation_bytes an element (the autocast dtype's), each tensor read
    once and written once; parameters, gradients and AdamW's moments are float32.
    - matmul: 2 FLOPs per weight per token forward, 4 backward (the input's and the weight's
      gradients), over the blocks' 12*C*C weights and the head's C*V;
    - attention: q.k and the weighted sum of v over the causal pairs only (position t sees t+1), 4*C
      FLOPs a pair forward, twice that backward: 6*C*(T+1) a token a layer;
    - loss: the logits read and their gradient written;
    - normalization: each of the 2L+1 LayerNorms reads x and writes y, then reads dy and x and writes dx;
    - element-wise: GELU (reads and writes 4C forward; reads 8C, writes 4C backward), the two residual
      adds a layer (3C forward, 3C backward), the embeddings (3C forward, 3C backward);
    - optimizer: the clip's norm reads every gradient, AdamW reads parameter, gradient and both moments
      and writes parameter and moments;
    - copies: the batch, inputs and targets as int64."""
    L, C, V, T = config.n_layer, config.n_embd, config.vocab_size, config.block_size
    return {"matmul": (FLOPS, 6 * tokens * (12 * L * C * C + C * V)),
            "attention": (FLOPS, 6 * tokens * L * C * (T + 1)),
            "normalization": (BYTES, 5 * (2 * L + 1) * C * tokens * activation_bytes),
            "loss": (BYTES, 2 * V * tokens * activation_bytes),
            "optimizer": (BYTES, (1 + 7) * 4 * n_params(config)),
            "copies": (BYTES, 2 * 8 * tokens),
            "element-wise": (BYTES, (L * (20 + 12) + 6) * C * tokens * activation_bytes)}


def floors(profile, work, ceilings):
    """profile's rows (profile_table's) with each category's floor, the least ms per step its work
    allows at ceilings ({FLOPS: the matmul rate, BYTES: the copy bandwidth, per second}), and the
    ratio of its time to it; and the step's wall time against the sum of the floors."""
    rows = []
    for row in profile["rows"]:
        if row["category"] in work:
            unit, amount = work[row["category"]]
            floor = 1000 * amount / ceilings[unit]
            row = dict(row, work=amount, unit=unit, floor_ms_per_step=floor, ratio=row["ms_per_step"] / floor)
        rows.append(row)
    floor = sum(row.get("floor_ms_per_step", 0) for row in rows)
    return dict(rows=rows, floor_ms_per_step=floor, ratio=profile["wall_ms_per_step"] / floor,
                ceilings=dict(matmul_flops_per_sec=ceilings[FLOPS], copy_bytes_per_sec=ceilings[BYTES]))


def print_profile(result):
    print(f"\nprofile of train's step: {result['config']}")
    if "rows" not in result:
        print("out of memory" if result.get("out_of_memory") else f"failed, {result.get('error')}")
        return
    print(f"{result['steps']} steps profiled, {result['wall_ms_per_step']:,.1f} ms per step under the profiler")
    ceilings = result["ceilings"]
    print(f"floor: the least ms/step of the category's work (docs/benchmarks.md) at this device's "
          f"{ceilings['matmul_flops_per_sec'] / 1e12:.3g} TFLOP/s (matmul) and {ceilings['copy_bytes_per_sec'] / 1e9:.3g} "
          f"GB/s (copy, read + written); ratio: ms/step over floor")
    print(f"{'category':<14}{'ms/step':>10}{'share':>8}{'floor':>11}{'ratio':>12}")
    for row in result["rows"] + [dict(category="step", ms_per_step=result["wall_ms_per_step"], share=100,
                                      floor_ms_per_step=result["floor_ms_per_step"], ratio=result["ratio"])]:
        # Each number after a space of its own: one wider than its column (a ratio of millions) never merges with the next.
        floor = f" {row['floor_ms_per_step']:>10.3g} {row['ratio']:>10,.1f}x" if "ratio" in row else ""
        print(f"{row['category']:<13} {row['ms_per_step']:>9,.1f} {row['share']:>6.1f}%{floor}")
    print(f"idle: {result['idle_means']}")
    print(f"trace: {result['trace'] or 'not written'}")
