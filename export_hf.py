"""Exports a model as a standard Hugging Face GPT-2 directory: config.json,
model.safetensors and GPT-2's tokenizer files, loadable offline by GPT2LMHeadModel,
AutoTokenizer, pipeline("text-generation"), lm_eval, or pushed to the hub as is.

    python export_hf.py log/ckpt_019073.pt hf/my-gpt2

The source is anything load_model takes: a checkpoint of train_gpt2.py, a Hugging
Face GPT-2 directory, or gpt2 ... gpt2-xl. A vocabulary padded for speed (50304) is
cut back to GPT-2's 50257 tokens. The export is written to a temporary directory,
checked against the source model, and only then renamed to OUT_DIR.
"""
if __name__ == "__main__":  # first: a Ctrl-C during the imports below, seconds long, is one line, not a traceback
    from gpt2repro.common.cli import exit_on_ctrl_c
    exit_on_ctrl_c()

import json
import os
import shutil
import tempfile
from functools import lru_cache

import torch
from safetensors import SafetensorError
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from gpt2repro.common.cli import Parser
from gpt2repro.common.inputs import first_line
from gpt2repro.lm.tokenizer import EOT, N_VOCAB, get_encoding
from gpt2repro.runs.dcp_reader import CheckpointError
from gpt2repro.runs.loading import load_model_on

EOT_TEXT = "<|endoftext|>"
CHECK_TEXT = "Hello, I'm a language model, and I can't wait to see 3.14159 ünïcödé   spaces!"


# -----------------------------------------------------------------------------
# the tokenizer files, derived from the vendored tiktoken ranks

def bytes_to_unicode():
    """GPT-2's map from the 256 byte values to printable characters: Hugging Face's
    tokenizer files hold tokens as text, and a raw space or control byte would not
    survive there. Printable Latin-1 bytes stand for themselves; the other 68 bytes
    take the code points from 256 up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, n_moved = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n_moved)
            n_moved += 1
    return table


def merge_parts(token, ranks):
    """The two tokens whose merge made token: BPE run on token's bytes with only the
    merges ranked before it stops one merge short, at exactly those two parts."""
    rank = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        # A pair that is no token, or a token ranked after this one, is not mergeable yet.
        pair_ranks = [ranks.get(a + b, rank) for a, b in zip(parts, parts[1:])]
        best = min(pair_ranks)
        if best >= rank:
            break
        i = pair_ranks.index(best)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


@lru_cache(maxsize=None)  # a second's work, the same for every export
def gpt2_vocab_and_merges():
    """vocab.json's {token text: id} and merges.txt's pairs, in rank order. tiktoken's
    rank of a token is both its GPT-2 id and the priority of the merge that makes it."""
    enc = get_encoding()
    ranks = {enc.decode_single_token_bytes(i): i for i in range(EOT)}
    byte_char = bytes_to_unicode()

    def text(token):
        return "".join(byte_char[b] for b in token)

    vocab = {text(token): i for token, i in ranks.items()}
    vocab[EOT_TEXT] = EOT
    merges = []
    for token in sorted(ranks, key=ranks.get):
        if len(token) > 1:
            parts = merge_parts(token, ranks)
            assert len(parts) == 2, f"{token!r} is not the merge of two earlier tokens"
            merges.append((text(parts[0]), text(parts[1])))
    return vocab, merges


def write_tokenizer(out_dir, model_max_length):
    """vocab.json and merges.txt (slow tokenizers, any transformers version), and the same
    BPE as tokenizer.json (fast tokenizers), as in OpenAI's gpt2 repository on the hub."""
    vocab, merges = gpt2_vocab_and_merges()
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split regex, then bytes
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(EOT_TEXT, special=True)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = dict(
        tokenizer_class="GPT2Tokenizer", model_max_length=model_max_length, add_prefix_space=False,
        bos_token=EOT_TEXT, eos_token=EOT_TEXT, unk_token=EOT_TEXT, errors="replace",
        clean_up_tokenization_spaces=False,  # else decode turns " ," into "," and text stops round-tripping
    )
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


# -----------------------------------------------------------------------------
# the model

def hf_config(config):
    # The model's one dropout rate as GPT-2's three, which GPT applies where Hugging Face does (not
    # GPT2Config's defaults, OpenAI's 0.1).
    return GPT2Config(
        vocab_size=N_VOCAB, n_positions=config.block_size, n_embd=config.n_embd, n_layer=config.n_layer,
        n_head=config.n_head, activation_function="gelu_new", resid_pdrop=config.dropout, embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        bos_token_id=EOT, eos_token_id=EOT, tie_word_embeddings=True,
    )


def write_model(model, out_dir):
    hf = GPT2LMHeadModel(hf_config(model.config))
    hf.load_state_dict(model.to_hf_state_dict())  # strict: every tensor, in both directions
    hf.save_pretrained(out_dir)  # config.json, model.safetensors (the tied head stored once)


@torch.no_grad()
def check_export(model, out_dir):
    """Loads the export back as Hugging Face would and compares it with the source model:
    token ids with tiktoken's, logits with ours. Returns the largest logit difference."""
    enc = get_encoding()
    ids = AutoTokenizer.from_pretrained(out_dir)(CHECK_TEXT).input_ids
    if ids != enc.encode_ordinary(CHECK_TEXT):
        raise RuntimeError("the exported tokenizer disagrees with tiktoken")
    idx = torch.tensor([ids[: model.config.block_size]])
    hf = GPT2LMHeadModel.from_pretrained(out_dir).eval()
    diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
    if not diff < 1e-3:
        raise RuntimeError(f"the exported model's logits differ from the source's by {diff:.2e}")
    return diff


def outermost_missing(path):
    """The outermost of path and its ancestors that does not exist; None if path exists."""
    missing = None
    while not os.path.exists(path):
        missing, path = path, os.path.dirname(path)
    return missing


def export(model, out_dir, force):
    """Writes everything to a temporary sibling of out_dir, checks it, then renames it into
    place: a failure at any point leaves out_dir, and the directories above it, as they were."""
    parent = os.path.dirname(out_dir)
    made = outermost_missing(parent)  # the first directory this call creates: a failure removes it, tmp and all
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", suffix=".partial", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private to us; an export is meant to be shared
        write_model(model, tmp)
        write_tokenizer(tmp, model.config.block_size)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)  # some writers make their files private too
        diff = check_export(model, tmp)
        if force and os.path.isdir(out_dir) and os.listdir(out_dir):
            shutil.rmtree(out_dir)  # only now that its replacement is complete
        os.rename(tmp, out_dir)  # atomic; replaces an empty directory
    except BaseException:
        shutil.rmtree(made or tmp, ignore_errors=True)
        raise
    return diff


def main(argv=None):
    parser = Parser(prog="export_hf.py", description="Export a model as a Hugging Face GPT-2 directory.")
    parser.add_argument("model",
                        help="a checkpoint (log/ckpt_XXXXXX.pt), a run's log directory (its newest checkpoint), "
                             "a Hugging Face GPT-2 directory, or gpt2 ... gpt2-xl")
    parser.add_argument("out_dir", help="the directory to create")
    parser.add_argument("--force", action="store_true", help="replace out_dir if it exists and is not empty")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()  # the export's own one-line report is enough

    out_dir = os.path.abspath(args.out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        parser.fail(f"{args.out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not args.force:
        parser.refuse_to_replace(args.out_dir, "exists and is not empty")
    try:
        model, _ = load_model_on(args.model)
    except CheckpointError as e:
        parser.fail(str(e))
    if not model.config.bias:
        parser.fail(f"{args.model}: a model without biases (bias=False) is not a GPT-2 architecture")
    try:
        diff = export(model, out_dir, args.force)
    except (OSError, RuntimeError, SafetensorError) as e:  # safetensors reports a full disk as its own error
        parser.fail(f"exporting to {args.out_dir}: {first_line(e)}")
    n_params = sum(t.numel() for key, t in model.to_hf_state_dict().items() if key != "lm_head.weight")  # tied
    print(f"exported {args.model} to {args.out_dir}: {n_params / 1e6:.1f}M parameters, vocab {N_VOCAB}, "
          f"block {model.config.block_size}; logits match to {diff:.1e}")


if __name__ == "__main__":
    main()
