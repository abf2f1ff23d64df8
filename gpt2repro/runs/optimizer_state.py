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


def saved_optimizer_problem(raw_model, optimizer, saved):
    """Why saved (optimizer.state_dict()'s form, as one file holds it) holds a state that torch's
    load would cast into shape rather than refuse, or None: each tensor of a parameter's state
    (AdamW's moments, Muon's momentum) must be of the parameter's dtype, as the optimizer keeps
    it (a bool one would be loaded as moments of 0 and 1), and its step count a real number, not
    a bool. A sharded checkpoint's are read as the dtype the optimizer holds, or refused
    (dcp_reader). What load leaves is checked after it (optimizer_state_problem)."""
    names = parameter_names(raw_model)
    for inner, saved_inner in saved_states_of(optimizer, saved):
        # Matched as torch's load matches them: the saved ids, in group order, to this run's parameters.
        saved_ids = [i for group in saved_inner["param_groups"] for i in group["params"]]
        params = [p for group in inner.param_groups for p in group["params"]]
        for i, param in zip(saved_ids, params):
            for key, value in saved_inner["state"].get(i, {}).items():
                problem = saved_value_problem(key, value, param)
                if problem:
                    return f"the state of {names[id(param)]}: {key} {problem}"
    return None


def saved_value_problem(key, value, param):
    """Why value, saved under key of param's optimizer state, is not of the kind that state holds, or None."""
    tensor = isinstance(value, torch.Tensor)
    if key == "step":
        real = tensor and value.dtype != torch.bool and not value.dtype.is_complex or type(value) in (int, float)
        return None if real else f"is {value.dtype if tensor else brief(value)}, not a count"
    if tensor and value.dtype != param.dtype:
        return f"is {value.dtype}, not its parameter's {param.dtype}"
    return None  # not a tensor: loaded as it is, and refused then


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


def optimizer_state_problem(raw_model, optimizer):
    """Why the state that optimizer has loaded cannot step raw_model's parameters, or None: each
    tensor of a parameter's state (AdamW's moments, Muon's momentum) finite and of the parameter's
    shape, AdamW's exp_avg_sq (a mean of squares) 0 or more, and its step count one finite number,
    0 or more. torch loads a tampered one as it is (casting its tensors to the parameter's dtype
    and device), to fail at the first step or train on from NaN. The param groups' settings are
    this run's own (with_run_settings), checked as its flags are."""
    names = parameter_names(raw_model)
    for inner in torch_optimizers(optimizer):
        for param in (p for group in inner.param_groups for p in group["params"]):
            for key, value in inner.state.get(param, {}).items():
                problem = state_value_problem(key, value, param)
                if problem:
                    return f"the state of {names.get(id(param), 'a parameter')}: {key} {problem}"
    return None


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


def parameter_names(raw_model):
    """{id(parameter): its plain GPT name} of raw_model's parameters."""
    return {id(p): name for name, p in plain_state_dict(dict(raw_model.named_parameters())).items()}


def number_in(value, low, high):
    """Whether value is an int or a float (not a bool) in [low, high)."""
    return type(value) in (int, float) and low <= value < high


def is_rate(value):
    """Whether value can be a learning rate that others are scaled by: a positive finite number."""
    return number_in(value, 0, math.inf) and value > 0
