"""A GPT's weights in a checkpoint, for a run that resumes (ModelPart) and for every script that
loads a model (loading.py): the GPT a checkpoint's config describes, the weights checked before
they load (a float dtype, the tied head equal to the embedding) and after (finite). Nothing here
knows of the optimizer or of when a run saves (checkpoint.py)."""
import math
from dataclasses import replace

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gpt2repro.common.distributed import every_rank
from gpt2repro.common.inputs import brief, first_line
from gpt2repro.runs.checkpoint_files import Unrestorable, refuse_on_every_rank
from gpt2repro.runs.dcp_reader import CheckpointError
from model import GPT, GPTConfig


class ModelPart:
    """The weights of raw_model, the plain GPT (FSDP-sharded or not): state_dict() with plain GPT
    keys, whole, as one file holds them; either form is checked before it loads (saved_weights_problem,
    on each rank's slices of a sharded one), loads into a model sharded or not, and is then checked
    on every rank, as the scripts check a model they load (non_finite_weights)."""

    def __init__(self, raw_model):
        self.raw_model = raw_model

    def finite(self):
        """Whether every weight is finite (of a sharded one, this rank's slices)."""
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.raw_model.parameters()]
        return bool(torch.stack([p.isfinite().all() for p in local]).all())

    def state_dict(self):
        return self.raw_model.state_dict()

    def load_state_dict(self, saved):
        refuse_on_every_rank(saved_weights_problem(saved))
        if isinstance(self.raw_model, FSDPModule):  # every rank has read all of it, and keeps its own slices
            set_model_state_dict(self.raw_model, saved, options=StateDictOptions(full_state_dict=True))
        else:
            self.raw_model.load_state_dict(saved)
        self.check()

    def dcp_state_dict(self):
        return get_model_state_dict(self.raw_model)

    def load_dcp_state_dict(self, loaded):
        refuse_on_every_rank(saved_weights_problem(loaded))
        set_model_state_dict(self.raw_model, loaded)
        self.check()

    def check(self):
        """Every rank stops alike, naming the weight: a run resumed from NaN would fail steps
        later, at a save or an evaluation, blaming neither the checkpoint nor the weight."""
        if not all(every_rank(self.finite())):
            raise Unrestorable(non_finite_weights(self.raw_model))


def saved_weights_problem(saved):
    """Why saved, a GPT's state dict as a checkpoint holds it (of a sharded one, this rank's slices
    as read), holds weights that loading would cast or drop rather than refuse, or None: each of a
    float dtype (a bool or integer one would load as whole numbers), and the head, tied to the
    token embedding, equal to it (loaded into the one tensor they share, it would overwrite the
    embedding). Their shapes loading checks."""
    saved = {name: t.to_local() if isinstance(t, DTensor) else t for name, t in saved.items()}
    for name, tensor in saved.items():
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
            return f"{name} is {tensor.dtype}, not a float dtype"
    head, embedding = saved.get("lm_head.weight"), saved.get("transformer.wte.weight")
    if isinstance(head, torch.Tensor) and isinstance(embedding, torch.Tensor) and not (
            head.shape == embedding.shape and torch.allclose(head, embedding, rtol=0, atol=0, equal_nan=True)):
        return "lm_head.weight differs from transformer.wte.weight, which GPT-2's head is (one tensor, tied)"
    return None


def non_finite_weights(model):
    """"NAME holds NaN or infinite values" for the first weight of model (a GPT) that does, with
    the rows where they lie if only rows that pad the vocabulary hold them, or None. Of a sharded
    model, on every rank at once: each weight is gathered whole."""
    for name, tensor in model.state_dict().items():
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if not whole.isfinite().all():
            return f"{name} holds NaN or infinite values{padding_only(model, name, whole)}"
    return None


def overflow_cause(model):
    """What in model's weights (a GPT, sharded or not, on every rank at once) makes a forward pass
    over token ids it has rows for give NaN or infinity: the first weight that is not finite, or
    else the one of the largest magnitude, with that magnitude."""
    problem = non_finite_weights(model)
    if problem:
        return problem
    sizes = {}
    for name, tensor in model.state_dict().items():
        size = torch.linalg.vector_norm(tensor.detach(), math.inf)  # the largest element's magnitude
        sizes[name] = (size.full_tensor() if isinstance(size, DTensor) else size).item()
    name = max(sizes, key=sizes.get)
    return f"its largest weight, in {name}, is {sizes[name]:.3g}"


def padding_only(model, name, tensor):
    """", only in rows 50257-50303, ..." where the non-finite values of model's weight name (tensor)
    lie only in the rows that pad its vocabulary (the token embedding's, which the head shares), else ""."""
    rows, vocab = model.config.vocab_size, model.n_tokens
    if name not in ("transformer.wte.weight", "lm_head.weight") or rows == vocab or not tensor[:vocab].isfinite().all():
        return ""
    return f", only in rows {vocab}-{rows - 1}, which pad the vocabulary and which no token id reaches"


def model_of(path, config, dropout=None, **options):
    """A GPT of a checkpoint's config (GPTConfig's fields as a dict; one without dropout, older,
    has none), or a CheckpointError; dropout, if given, instead of the recorded one; options: how
    it runs, as GPT's."""
    try:
        model_config = GPTConfig(**model_fields(path, config))
        return GPT(model_config if dropout is None else replace(model_config, dropout=dropout), **options)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a checkpoint of this GPT ({first_line(e)})") from None


def model_fields(path, config):
    """A checkpoint's config (a dict of plain values: contents_problem), checked to hold GPTConfig's
    fields and only those (dropout may be missing: GPTConfig once had none): a field of another,
    or one missing, is a CheckpointError, named within bounds."""
    unknown = next((k for k in config if k not in GPTConfig.__dataclass_fields__), None)
    if unknown is not None:
        raise CheckpointError(f"{path}: not a checkpoint of this GPT (its config has a field {brief(unknown)}, "
                              f"which GPTConfig lacks)")
    missing = next((k for k in GPTConfig.__dataclass_fields__ if k not in config and k != "dropout"), None)
    if missing is not None:
        raise CheckpointError(f"{path}: not a checkpoint of this GPT (its config lacks GPTConfig's field {missing})")
    return config
