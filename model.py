"""GPT-2, exactly: the architecture of OpenAI's checkpoints, with parameter names
equal to Hugging Face's GPT2LMHeadModel so weights move between the two freely.
"""
import inspect
import re
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from gpt2repro.common.inputs import brief
from gpt2repro.common.settings import setting
from gpt2repro.lm import generate
from gpt2repro.lm.loss import LOSSES, chunked_cross_entropy, masked_cross_entropy
from gpt2repro.lm.tokenizer import N_VOCAB


@dataclass
class GPTConfig:
    """What the model is: all that a checkpoint's config records of it. dropout is how it trains,
    not its architecture: GPT-2's, at one rate (OpenAI's 0.1), after the embeddings, on each
    residual branch and on the attention probabilities, in training mode only; at 0.0, as in
    build-nanogpt, the forward is exactly that of a GPT without it."""
    block_size: int = setting(1024, "context length of the model")
    vocab_size: int = setting(50257, "embedding rows: GPT-2's 50257 padded to a multiple of 128")
    n_layer: int = setting(12, "transformer blocks")
    n_head: int = setting(12, "attention heads per block")
    n_embd: int = setting(768, "width of the residual stream")
    dropout: float = setting(0.0, "dropout probability in training (GPT-2's is 0.1; 0: none)")
    bias: bool = True  # biases in Linear layers and LayerNorms, as in GPT-2

    def __post_init__(self):  # a config read from a file fails here, in one line, not deep in a layer
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, not {brief(getattr(self, name))}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head {self.n_head} does not divide n_embd {self.n_embd}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a probability in [0, 1), not {self.dropout!r}")


def n_params(config):
    """Parameters of a GPT of config: the head is tied to the token embedding."""
    C, L = config.n_embd, config.n_layer
    block = 12 * C * C + 13 * C  # qkv, projection and MLP matrices with their biases, two LayerNorms
    return (config.vocab_size + config.block_size) * C + L * block + 2 * C


# OpenAI's four sizes, as Hugging Face names them.
PRETRAINED = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# What a block recomputes in the backward pass instead of keeping its activations (PaddleFleetX's
# granularities): nothing, the whole block, the attention sublayer (ln_1 to c_proj), or only SDPA.
RECOMPUTE = ("none", "full", "attn", "core_attn")
# --attention: the SDPA backends every layer may use (None: torch's choice, flash attention on recent GPUs).
ATTENTION_KERNELS = {"auto": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "math": [SDPBackend.MATH]}

# Hugging Face stores these as Conv1D weights, (in, out): the transpose of nn.Linear's.
HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_layout(key, tensor):
    """The parameter key's tensor in the other one's layout, Hugging Face's or this model's: a
    transpose is its own inverse."""
    return tensor.t() if key.endswith(HF_TRANSPOSED) else tensor


def hf_weights_problem(config, declared):
    """Why declared ({name: (shape, dtype)}, the weights a Hugging Face GPT-2's files declare:
    hf_files.declared_weights) are not those of a GPT of config, or None: the blocks 0 to n_layer - 1
    and no others, each weight there and of its shape in Hugging Face's layout, of a float dtype (a
    bool or int8 one would load as whole numbers); the head may be left out (tied). Asked before
    anything is built: a config.json of n_layer 1,000,000 beside 2 blocks would build a million."""
    with torch.device("meta"):  # shapes alone: one block's weights are every block's
        template = GPT(replace(config, n_layer=1)).state_dict()
    found = {}
    for name, (shape, dtype) in declared.items():
        if not name.endswith((".attn.bias", ".attn.masked_bias")):  # older transformers' mask buffers
            found[name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"] = shape, dtype
    blocks = {int(match.group(1)) for key in found if (match := re.match(r"transformer\.h\.(\d+)\.", key))}
    if blocks != set(range(config.n_layer)):
        held = f"blocks 0 to {max(blocks)}" if blocks == set(range(len(blocks))) else f"{len(blocks):,} blocks"
        return f"config.json's n_layer is {config.n_layer:,}, but its weights hold {held if blocks else 'no block'}"
    for key, (shape, dtype) in found.items():
        like = re.sub(r"^transformer\.h\.\d+\.", "transformer.h.0.", key)
        if like not in template:
            return f"parameter {key} is unexpected"
        expected = tuple(hf_layout(like, template[like]).shape)
        if shape != expected:
            return f"{key} has shape {shape}, expected {expected} (config.json's)"
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return f"{key} is stored as {dtype}, not a float dtype"
    missing = next((key.replace(".h.0.", f".h.{i}.") for key in template if key != "lm_head.weight"
                    for i in (range(config.n_layer) if ".h.0." in key else [0])
                    if key.replace(".h.0.", f".h.{i}.") not in found), None)
    return f"parameter {missing} is missing" if missing else None


def padding_mask(n_pad, start, T):
    """(B, 1, T, start + T), True where the query at position start + i may attend to key j:
    j <= start + i, and j is not one of the row's n_pad leading pads. A pad attends to itself,
    so that no row of the softmax is empty (NaN, which would reach every later position)."""
    query = torch.arange(start, start + T, device=n_pad.device)[:, None]
    key = torch.arange(start + T, device=n_pad.device)
    real = key >= n_pad[:, None, None]  # (B, 1, start + T)
    return ((key <= query) & (real | (key == query)))[:, None]


def recomputed(fn, on):
    """fn, or, when on and gradients are being recorded, fn run again in the backward pass instead
    of its activations kept. Non-reentrant, the form torch recommends."""
    return partial(checkpoint, fn, use_reentrant=False) if on and torch.is_grad_enabled() else fn


class CausalSelfAttention(nn.Module):
    def __init__(self, config, attention=None, recompute_core=False):
        super().__init__()
        self.kernels = attention  # the SDPA backends it may use (None: torch's choice)
        self.recompute_core = recompute_core  # SDPA run again in the backward pass
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout  # of the attention probabilities, inside SDPA
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_PROJECTION = True
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv_cache=None, mask=None):
        """kv_cache: this layer's [keys, values] of earlier positions, extended in place
        (generation, and answers scored after a shared context). mask (B, 1, T, positions), True
        where a query may attend: for left-padded batches and packed answers; without it attention
        is causal over the cache and the new tokens."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            if kv_cache:
                # SDPA's is_causal aligns the queries with the first keys, not the last: after a warm
                # cache only a lone query, which may see every key, or an explicit mask is right.
                assert T == 1 or mask is not None, "with a warm cache, feed one token at a time or pass a mask"
                k = torch.cat([kv_cache[0], k], dim=2)
                v = torch.cat([kv_cache[1], v], dim=2)
            kv_cache[:] = [k, v]
        y = recomputed(self.core, self.recompute_core)(q, k, v, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def core(self, q, k, v, mask):
        # A fused kernel (flash, cuDNN); a lone new query may see every earlier position, so needs no mask. An
        # explicit mask (padding) takes SDPA off its fastest kernels: only generation passes one.
        # The backends are chosen here, inside the forward: a compiled graph picks its kernel when
        # traced, and does not see an sdpa_kernel context around the call.
        with sdpa_kernel(self.kernels) if self.kernels else nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and q.size(2) > 1,
                                                  dropout_p=self.dropout if self.training else 0.0)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_PROJECTION = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config, recompute="none", attention=None):
        super().__init__()
        self.recompute = recompute  # one of RECOMPUTE
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, attention, recompute_core=recompute == "core_attn")
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, mask=None):
        return recomputed(self._forward, self.recompute == "full")(x, kv_cache, mask)

    def _forward(self, x, kv_cache, mask):
        x = x + recomputed(self.attention, self.recompute == "attn")(x, kv_cache, mask)
        return x + self.mlp(self.ln_2(x))

    def attention(self, x, kv_cache, mask):
        return self.attn(self.ln_1(x), kv_cache, mask)


class GPT(nn.Module):
    def __init__(self, config, recompute="none", recompute_every=1, attention=None):
        """How it runs, never what it computes: recompute (one of RECOMPUTE) in blocks 0,
        recompute_every, 2*recompute_every, ... (less memory, more compute); attention, the SDPA
        backends every layer may use (a list of torch.nn.attention.SDPBackend; None: torch's choice)."""
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, recompute if i % recompute_every == 0 else "none", attention)
                             for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_PROJECTION", False):
                # Each block adds two projections to the residual stream: keep its variance flat.
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def n_tokens(self):
        """Ids the model may emit: the vocabulary less the rows padded on for speed."""
        return min(self.config.vocab_size, N_VOCAB)

    def forward(self, idx, targets=None, kv_cache=None, n_pad=None, loss_kind="masked"):
        """idx (B, T) token ids -> logits (B, T, n_tokens) and the mean cross-entropy
        against targets (B, T), where a target of -1 is ignored. kv_cache, n_pad: see hidden_states.
        loss_kind: how the loss is computed (loss.py): masked, or chunked or fused (training), which
        give the same loss without ever holding the logits, and return none."""
        x = self.hidden_states(idx, kv_cache, n_pad)
        if targets is None:
            return self.head(x), None
        if loss_kind not in LOSSES:
            raise ValueError(f"loss_kind must be one of {', '.join(LOSSES)}, not {loss_kind!r}")
        if loss_kind != "masked":
            return None, chunked_cross_entropy(x, self.lm_head.weight, targets, self.n_tokens, loss_kind == "fused")
        logits = self.padded_head(x)
        return logits[..., : self.n_tokens], masked_cross_entropy(logits, targets, self.n_tokens)

    def hidden_states(self, idx, kv_cache=None, n_pad=None, layout=None):
        """idx (B, T) -> the final hidden states (B, T, n_embd) that the language-model head reads.
        kv_cache: a list of one [] per layer, each extended with that layer's keys and values, so a
        later call feeds only the new tokens (generation). n_pad (B,): how many of each row's first
        positions are left padding (generation of prompts of several lengths); a row's positions
        count from its first real token, and no position attends to padding. layout: (positions
        (B, T), mask (B, 1, T, cached + T)) of tokens that are not one sequence a row, such as
        several answers packed after one cached context (core_eval.py); each position below
        block_size, and the mask True where a query may attend (every query somewhere)."""
        B, T = idx.size()
        start = kv_cache[0][0].size(2) if kv_cache and kv_cache[0] else 0
        if layout is not None:
            pos, mask = layout
        elif start + T > self.config.block_size:
            raise ValueError(f"sequence of length {start + T} is longer than block_size {self.config.block_size}")
        else:
            pos, mask = torch.arange(start, start + T, dtype=torch.long, device=idx.device), None
        if n_pad is not None:
            mask = padding_mask(n_pad, start, T)
            pos = (pos - n_pad[:, None]).clamp(min=0)  # (B, T); the padding's own positions do not matter
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for i, block in enumerate(self.transformer.h):
            x = block(x, kv_cache[i] if kv_cache is not None else None, mask)
        return self.transformer.ln_f(x)

    def head(self, x):
        """Hidden states (..., n_embd) -> logits (..., n_tokens): the padding rows are sliced away,
        so that sampling and scoring never see them. A caller that needs few positions' logits
        passes only those."""
        return self.padded_head(x)[..., : self.n_tokens]

    def padded_head(self, x):
        """Hidden states (..., n_embd) -> logits (..., vocab_size), padding columns included (the
        matmul is faster at 50304). Outside autocast it computes in x's dtype, also where FSDP
        gathered the weight in bf16."""
        weight = self.lm_head.weight
        if not torch.is_autocast_enabled(x.device.type):
            weight = weight.to(x.dtype)
        return F.linear(x, weight)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=50, top_p=None, generator=None, n_pad=None,
                 **options):
        """Continue each row of idx (B, T) by up to max_new_tokens tokens: sampled, or greedy at
        temperature 0; options (decode="beam", num_beams, ...) and n_pad (B,), the left
        padding of each row, as in generate.py. Returns the prompts and their continuations."""
        config = generate.GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                           top_p=top_p, **options)
        return generate.generate(self, idx, config, n_pad, generator)

    def configure_optimizers(self, weight_decay, learning_rate, device_type, fused=None, exclude=()):
        """AdamW as GPT-2/3: matrices and embeddings decay; biases and LayerNorm gains do not.
        exclude: parameters another optimizer takes (--optimizer muon: the blocks' matrices)."""
        skip = {id(p) for p in exclude}
        params = [p for p in self.parameters() if p.requires_grad and id(p) not in skip]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if fused is None:  # one kernel for all parameters instead of a loop of small ones
            fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused)

    def flops_per_token(self, seq_len):
        """Training FLOPs (forward + backward) per token, PaLM appendix B: 6N + 12·L·H·Q·T,
        with N the parameters less the position embedding (it does no matmul)."""
        cfg = self.config
        n = sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * seq_len

    @classmethod
    def from_pretrained(cls, name_or_path, local_files_only=False, dropout=0.0, **options):
        """OpenAI's GPT-2 ("gpt2" ... "gpt2-xl", from the Hugging Face hub or its local cache) or a
        local directory holding a Hugging Face GPT-2 checkpoint; options: how it runs, as GPT's.
        dropout is the caller's (a fine-tune's --dropout), never the directory's pdrops."""
        from transformers import GPT2Config, GPT2LMHeadModel

        from gpt2repro.lm.hf_files import declared_weights

        hf = GPT2Config.from_pretrained(name_or_path, local_files_only=local_files_only)  # checked before any weight is read
        # The config fields that change the maths, with the values at which it is GPT-2's: the
        # weights alone would load into a model that computes something else. (A field that adds
        # weights, such as add_cross_attention, fails load_hf_state_dict instead.) Not among them:
        # reorder_and_upcast_attn, which computes the same attention scores, only in float32.
        gpt2_values = dict(
            activation_function=("gelu_new", "gelu_pytorch_tanh"), n_inner=(None, 4 * hf.n_embd),
            layer_norm_epsilon=(1e-5,), scale_attn_weights=(True,), scale_attn_by_inverse_layer_idx=(False,),
            tie_word_embeddings=(True,),  # we hold one tensor for both: an untied lm_head would overwrite wte
        )
        for field, values in gpt2_values.items():
            if getattr(hf, field) not in values:
                raise ValueError(f"{name_or_path}: not a GPT-2 architecture ({field}={getattr(hf, field)!r})")
        try:
            config = GPTConfig(block_size=hf.n_positions, vocab_size=hf.vocab_size,
                               n_layer=hf.n_layer, n_head=hf.n_head, n_embd=hf.n_embd, dropout=dropout)
        except ValueError as e:
            raise ValueError(f"config.json: {e}") from None
        found = declared_weights(name_or_path, local_files_only)
        problem = found and hf_weights_problem(config, found[1])
        if problem:
            raise ValueError(f"{found[0]}: {problem}")
        hf_model = GPT2LMHeadModel.from_pretrained(name_or_path, local_files_only=local_files_only)
        model = cls(config, **options)
        model.load_hf_state_dict(hf_model.state_dict(), source=name_or_path)
        return model

    def load_hf_state_dict(self, hf_sd, source="checkpoint"):
        """Copies a Hugging Face GPT2LMHeadModel state dict in, checking every key and shape."""
        # The causal-mask buffers of older transformers versions are not weights.
        hf_sd = {k: v for k, v in hf_sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        sd = self.state_dict()
        for key in sorted(set(sd) | set(hf_sd)):
            if key not in hf_sd or key not in sd:
                raise ValueError(f"{source}: parameter {key} is {'missing' if key not in hf_sd else 'unexpected'}")
            src = hf_layout(key, hf_sd[key])
            if src.shape != sd[key].shape:
                raise ValueError(f"{source}: {key} has shape {tuple(src.shape)}, expected {tuple(sd[key].shape)}")
        with torch.no_grad():
            for key, tensor in sd.items():
                tensor.copy_(hf_layout(key, hf_sd[key]))

    def to_hf_state_dict(self):
        """The inverse of load_hf_state_dict: this model's weights under Hugging Face's names
        and layouts, with the vocabulary cut back to n_tokens (padding rows are never used)."""
        hf_sd = {}
        for key, tensor in self.state_dict().items():
            if key in ("transformer.wte.weight", "lm_head.weight"):
                tensor = tensor[: self.n_tokens]
            hf_sd[key] = hf_layout(key, tensor).contiguous()
        return hf_sd
