"""Tiny models, as the tests build them: ours and Hugging Face's, their weights moved off their
init, and the checkpoints and parts a run would save of them."""
import torch


def make_hf_gpt2(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=128, seed=0, **config):
    """A random Hugging Face GPT-2 whose every parameter (LayerNorms too) is moved off its
    init value, so a loader that skipped or mis-transposed any tensor shows in the logits.
    config: more GPT2Config fields."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_positions=block_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        vocab_size=vocab_size, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, **config)
    hf = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


def make_tiny_gpt(vocab_size=50304, block_size=64, seed=0):
    """A tiny GPT with every parameter moved off its init value; vocab_size 50304 is the
    padded vocabulary of training."""
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=4, n_embd=32)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def make_eot_gpt(block_size=64):
    """make_tiny_gpt's model made to end its texts often: every hidden state leans along e, and
    so does <|endoftext|>'s output row, so its logit is near the best one in many contexts."""
    from gpt2repro.lm.tokenizer import EOT

    model = make_tiny_gpt(vocab_size=50304, block_size=block_size)
    e = torch.randn(32, generator=torch.Generator().manual_seed(1))
    e /= e.norm()
    with torch.no_grad():
        model.transformer.ln_f.bias.copy_(2 * e)
        model.lm_head.weight[EOT] = 1.4 * e
    return model


def save_as_checkpoint(model, path):
    """Writes model as train_gpt2.py's checkpoints hold it; returns path."""
    from dataclasses import asdict

    torch.save({"model": model.state_dict(), "config": asdict(model.config), "step": 10}, path)
    return str(path)


def parts_of(model, optimizer, scaler, loader):
    """checkpoint.training_parts of a run of model, optimizer, scaler and loader."""
    from types import SimpleNamespace

    from gpt2repro.runs.checkpoint import training_parts

    return training_parts(SimpleNamespace(raw_model=model, optimizer=optimizer, scaler=scaler), loader)


def as_checkpoint(parts, step, flags):
    """What a one-file checkpoint of parts at step holds, of a run of its own, with flags
    (TrainConfig.flags()) as its record, as a run of step steps of one micro-batch of its loader's each would save it: the
    loader step micro-batches in, the record's batch flags that micro-batch."""
    from gpt2repro.runs.checkpoint import checkpoint_record
    from gpt2repro.runs.checkpoint_files import checkpoint_contents, new_run_identity

    loader = parts["train_loader"].loader
    flags = {**flags, "total_batch_size": loader.tokens_per_index, "seq_len": loader.T}
    state = checkpoint_contents(parts, checkpoint_record(parts, step, flags, new_run_identity()))
    state["train_loader"].update(epoch=0, index=step)
    return state


class FixedBatches:
    """A loader that serves the same batches in the same order, for two runs to compare."""

    def __init__(self, batches):
        self.batches, self.i = batches, 0
        self.B, self.T = batches[0][0].shape
        self.tokens_per_index = batches[0][0].numel()

    def micro_steps(self, tokens_per_step):
        from gpt2repro.lm.data import ShardLoader

        return ShardLoader.micro_steps(self, tokens_per_step)  # the loader's own count, of these batches

    def next_batch(self):
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]
