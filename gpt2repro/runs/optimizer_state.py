"""An optimizer's state as a checkpoint holds it (the moments, momentum buffers and step counts that
the run's optimizer learned), loaded under this run's settings and checked before and after the
load: torch takes a crafted state as it is, casting its tensors into shape, to fail at the first
step or to train on from NaN. checkpoint.py's OptimizerPart restores it through these."""
import math

import torch
from torch.distributed.tensor import DTensor

from gpt2repro.common.inputs import brief
from gpt2repro.runs.checkpoint_files import plain_state_dict
from gpt2repro.training.optimizers import saved_states_of, torch_optimizers

# What each optimizer keeps of a parameter it has stepped: AdamW (never amsgrad here) its step
# count and two moments, Muon its momentum buffer alone (its update depends on no count).
STATE_KEYS = {torch.optim.AdamW: ("step", "exp_avg", "exp_avg_sq"), torch.optim.Muon: ("momentum_buffer",)}
# A clipped gradient's elements are at most the clip's norm: its float32 arithmetic (the norm's sum
# of squares, the moments' running means) may round past that bound, by far less than this.
ROUNDING = 1.01


def kept_keys(inner):
    """The keys inner (one of torch_optimizers) keeps in each parameter's state (STATE_KEYS)."""
    return next(keys for kind, keys in STATE_KEYS.items() if isinstance(inner, kind))


def kind_of(inner):
    """inner's name in a message: Muon, or AdamW."""
    return "Muon" if isinstance(inner, torch.optim.Muon) else "AdamW"


def saved_optimizer_problem(raw_model, optimizer, saved):
    """Why saved (optimizer.state_dict()'s form, as one file holds it) holds a state that torch's
    load would take, cast or drop rather than refuse, or None. Its param groups must number this
    run's parameters 0, 1, ... in order, as torch saves them, and its state be keyed by those
    numbers alone (a key that is none of them, a string or a shifted id, would be carried along
    unused into every later checkpoint); each parameter's state must hold what the optimizer keeps
    (kept_keys), each tensor of the parameter's dtype and shape, as the optimizer keeps it (a bool
    one would be loaded as moments of 0 and 1), its step count a real number, not a bool. A
    sharded checkpoint's are read as the optimizer holds them, or refused (dcp_reader). What load
    leaves is checked after it (optimizer_state_problem)."""
    names = parameter_names(raw_model)
    for inner, saved_inner in saved_states_of(optimizer, saved):
        params = [p for group in inner.param_groups for p in group["params"]]
        # Matched as torch's load matches them: the saved ids, in group order, to this run's parameters.
        saved_ids = [i for group in saved_inner["param_groups"] for i in group["params"]]
        if saved_ids != list(range(len(saved_ids))):
            return f"{kind_of(inner)}'s param groups number its parameters {brief(saved_ids)}, not 0, 1, ... in order"
        stray = next((key for key in saved_inner["state"] if type(key) is not int or not 0 <= key < len(params)), None)
        if stray is not None:
            return (f"{kind_of(inner)}'s state holds an entry keyed {brief(stray)}, which numbers none of its "
                    f"{len(params)} parameters (0 to {len(params) - 1})")
        for i, param in zip(saved_ids, params):
            problem = saved_state_problem(inner, saved_inner["state"].get(i, {}), param)
            if problem:
                return f"the state of {names[id(param)]}: {problem}"
    return None


def saved_state_problem(inner, state, param):
    """Why state, saved as param's in inner's (empty where it has none), is not what inner keeps, or None."""
    if not isinstance(state, dict):
        return f"it is {brief(state)}, not a dict"
    kept = kept_keys(inner)
    if state and set(state) != set(kept):
        extra = next((key for key in state if key not in kept), None)
        return (f"it holds {brief(extra)}, which {kind_of(inner)} keeps none of" if extra is not None else
                f"it holds no {next(key for key in kept if key not in state)}")
    for key, value in state.items():
        problem = saved_value_problem(key, value, param)
        if problem:
            return f"{key} {problem}"
    return None


def saved_value_problem(key, value, param):
    """Why value, saved under key of param's optimizer state, is not of the kind that state holds, or None."""
    tensor = isinstance(value, torch.Tensor)
    if key == "step":
        real = tensor and value.dtype != torch.bool and not value.dtype.is_complex or type(value) in (int, float)
        if not real:
            return f"is {value.dtype if tensor else brief(value)}, not a count"
        return f"has shape {tuple(value.shape)}, not one number" if tensor and value.numel() != 1 else None
    if tensor and value.dtype != param.dtype:
        return f"is {value.dtype}, not its parameter's {param.dtype}"
    if tensor and value.shape != param.shape:
        return f"has shape {tuple(value.shape)}, not its parameter's {tuple(param.shape)}"
    return None  # not a tensor: loaded as it is, and refused then


def with_tensors_of_their_own(optimizer, saved):
    """saved (optimizer.state_dict()'s form, checked by saved_optimizer_problem) with each state
    tensor that is a view (strided, expanded: torch.save keeps a stride-0 tensor so) or shares its
    memory with another replaced by a contiguous copy: torch's load keeps a tensor as it is and the
    optimizer updates it in place, where an expanded one fails (a traceback) and shared ones would
    add up each other's updates. Checked first, each copy is at most as large as its parameter."""
    seen = set()
    for _, saved_inner in saved_states_of(optimizer, saved):
        for state in saved_inner["state"].values():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                storage = value.untyped_storage()
                if (not value.is_contiguous() or value.storage_offset() or storage.data_ptr() in seen
                        or storage.nbytes() != value.numel() * value.element_size()):
                    state[key] = value = value.clone(memory_format=torch.contiguous_format)
                seen.add(value.untyped_storage().data_ptr())
    return saved


def keyed_by_name(raw_model, optimizer, saved):
    """saved, optimizer.state_dict()'s form, keyed by the parameters' order in each optimizer, as
    DCP's loader takes it: by their names, several optimizers' state as one, under this run's
    settings."""
    names = parameter_names(raw_model)
    by_name = {"state": {}, "param_groups": []}
    for inner, saved_inner in saved_states_of(optimizer, saved):
        order = [names[id(p)] for group in inner.param_groups for p in group["params"]]
        by_name["state"].update({order[i]: s for i, s in saved_inner["state"].items()})
        by_name["param_groups"] += [{**g, "params": [order[i] for i in g["params"]]}
                                    for g in with_run_settings(saved_inner["param_groups"], inner)]
    return by_name


def load_optimizer_state(optimizer, saved):
    """Loads saved (optimizer.state_dict()'s form) into optimizer: what the saved run learned (the
    moments, momentum buffers and step counters), under this run's settings, which its flags set:
    weight decay, betas, eps, Muon's momentum, nesterov and lr_scale (--muon_lr over --max_lr), and
    AdamW's kernel (a run saved on a CPU resumes with the fused AdamW on a GPU, and back). The
    settings go into the saved groups before loading: load_state_dict places each `step` counter
    by them (fused and capturable kernels read it as float32 on the parameter's device)."""
    for inner, saved_inner in saved_states_of(optimizer, saved):
        inner.load_state_dict({**saved_inner, "param_groups": with_run_settings(saved_inner["param_groups"], inner)})


def with_run_settings(saved_groups, optimizer):
    """saved_groups (a state dict's param_groups) with every setting of optimizer's groups in place
    of the saved ones: only each group's "params", which say whose state is whose, stay saved."""
    if len(saved_groups) != len(optimizer.param_groups):  # zip would drop the extra ones without a word
        raise ValueError(f"{len(saved_groups)} parameter groups saved, this run's optimizer has "
                         f"{len(optimizer.param_groups)}")
    return [{**saved_group, **{k: v for k, v in group.items() if k != "params"}}
            for saved_group, group in zip(saved_groups, optimizer.param_groups)]


def optimizer_state_problem(raw_model, optimizer, run=None):
    """Why the state that optimizer has loaded cannot step raw_model's parameters as the run that
    saved it would have, or None. torch loads a tampered one as it is (casting its tensors to the
    parameter's dtype and device), to fail at the first step, train on from NaN, or train on from
    numbers no run reaches. Each tensor of a parameter's state (AdamW's moments, Muon's momentum)
    finite and of the parameter's shape, AdamW's exp_avg_sq (a mean of squares) 0 or more; a state
    for every parameter or for none (every step steps them all: half a state would restart the
    other half's moments); AdamW's step counts one count (step_count_problem). Given run (the
    checkpoint's SavedRun), the counts at most its step and the moments within what its gradient
    clipping lets through (moment_bound_problem). The param groups' settings are this run's own
    (with_run_settings), checked as its flags are."""
    names = parameter_names(raw_model)
    stepped = [(p, bool(inner.state.get(p))) for inner in torch_optimizers(optimizer)
               for group in inner.param_groups for p in group["params"]]
    params, held = [p for p, _ in stepped], [h for _, h in stepped]
    if any(held) and not all(held):
        return (f"it holds no state for {names.get(id(params[held.index(False)]), 'a parameter')}, but holds one "
                f"for {names.get(id(params[held.index(True)]), 'another')}: every step steps every parameter")
    for inner in torch_optimizers(optimizer):
        for param in (p for group in inner.param_groups for p in group["params"]):
            for key, value in inner.state.get(param, {}).items():
                problem = state_value_problem(key, value, param) or moment_bound_problem(key, value, run)
                if problem:
                    return f"the state of {names.get(id(param), 'a parameter')}: {key} {problem}"
    return step_count_problem(optimizer, names, run)


def state_value_problem(key, value, param):
    """Why value, of key in param's optimizer state, cannot be stepped, or None."""
    if key == "step" and type(value) in (int, float):
        return None if number_in(value, 0, math.inf) else f"is {brief(value)}, not a count of 0 or more"
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if key == "step" and value.numel() != 1:
        return f"has shape {tuple(value.shape)}, not one number"
    if key != "step" and value.shape != param.shape:
        return f"has shape {tuple(value.shape)}, not its parameter's {tuple(param.shape)}"
    local = value.to_local() if isinstance(value, DTensor) else value
    if not local.isfinite().all():
        return "holds NaN or infinite values"
    if key == "exp_avg_sq" and (local < 0).any():
        return "holds negative values: a mean of squares is 0 or more"
    if key == "step" and local.item() < 0:
        return f"is {local.item():g}, not a count of 0 or more"
    return None


def moment_bound_problem(key, value, run):
    """Why value, the moment or momentum buffer key, holds what no step of run (a SavedRun) could
    have put there, or None. Clipped to a norm of --grad_clip, a gradient has no element larger; AdamW's
    exp_avg and Muon's momentum_buffer are running means of gradients (x <- b*x + (1-b)*g), so no
    element's size passes grad_clip, and exp_avg_sq, a running mean of squares, passes no
    grad_clip**2 (ROUNDING over both). Unclipped (--grad_clip 0), a gradient is any finite number."""
    bound = run.grad_clip if run else 0
    if key not in ("exp_avg", "exp_avg_sq", "momentum_buffer") or not bound:
        return None
    bound = ROUNDING * (bound ** 2 if key == "exp_avg_sq" else bound)
    local = value.to_local() if isinstance(value, DTensor) else value
    largest = torch.linalg.vector_norm(local, math.inf).item() if local.numel() else 0.0  # the largest element's size
    if largest > bound:
        what = "a running mean of squared gradients" if key == "exp_avg_sq" else "a running mean of gradients"
        return f"holds {largest:.3g}, past what {what} clipped at --grad_clip {brief(run.grad_clip)} reaches: " \
               f"{bound / ROUNDING:.3g}"
    return None


def step_count_problem(optimizer, names, run):
    """Why AdamW's step counts cannot be those of one run, or None: a count is how many steps
    stepped its parameter, a whole number, 1 or more where it has a state, the same for every
    parameter (one step steps them all); given run (a SavedRun), at most its step (a skipped step,
    a non-finite loss or fp16's overflow, counts none). Muon counts nothing."""
    counts = {}
    for inner in torch_optimizers(optimizer):
        for param, state in inner.state.items():
            if "step" in state:
                value = state["step"]
                count = float(value.item() if isinstance(value, torch.Tensor) else value)
                counts.setdefault(count, names.get(id(param), "a parameter"))
    for count, name in counts.items():
        if not (count >= 1 and count == int(count)):
            return f"the state of {name}: step is {count:g}, not a count of the steps it took (1 or more)"
    if len(counts) > 1:
        (a, first), (b, second) = list(counts.items())[:2]
        return (f"its step counts differ: {a:g} for {first}, {b:g} for {second}; every step steps every "
                f"parameter")
    if run and counts and next(iter(counts)) > run.step:
        return (f"its step count is {next(iter(counts)):g}, past the {run.step:,} steps of the run that "
                f"saved it")
    return None


def parameter_names(raw_model):
    """{id(parameter): its plain GPT name} of raw_model's parameters."""
    return {id(p): name for name, p in plain_state_dict(dict(raw_model.named_parameters())).items()}


def number_in(value, low, high):
    """Whether value is an int or a float (not a bool) in [low, high)."""
    return type(value) in (int, float) and low <= value < high


def is_rate(value):
    """Whether value can be a learning rate that others are scaled by: a positive finite number."""
    return number_in(value, 0, math.inf) and value > 0
