"""export_hf.py: the exported directory is a Hugging Face GPT-2 that matches ours, offline."""
import json
import os
import random
import shutil

import pytest
import torch
from transformers import AutoTokenizer, GPT2LMHeadModel, GPT2TokenizerFast, pipeline

import export_hf
from gpt2repro.lm.tokenizer import EOT, N_VOCAB, get_encoding
from gpt2repro.runs.dcp_reader import CheckpointError
from gpt2repro.runs.loading import load_model
from helpers import REPO
from helpers.models import make_hf_gpt2, make_tiny_gpt, save_as_checkpoint
from helpers.processes import exit_message
from model import GPT, GPTConfig

HELLO = "Hello, I'm a language model,"
TRICKY = [
    HELLO,
    "  two leading spaces,\ttabs\t\tand\n\n\nnewlines   \n and a trailing space ",
    "I'm, you're, they'll, we've, she'd, it's, DON'T, rock'n'roll",
    "3.14159 1,000,000 2024-01-01 12345678901234567890 -0.5e-10",
    "ünïcödé, 日本語, emoji 🤖🎉, Ελληνικά, Привет, \u00a0non-breaking",
    "punctuation !!! ??? ... ,,, ;-) \"quoted\" (paren) [x] {y} #tag @user",
    # Contractions are case-sensitive; byte 0xAD (in í, 中, the soft hyphen) is one GPT-2 remaps.
    "O'Sullivan'S 'SUP, aquí 中文 soft\u00adhyphen",
]


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """(our model, its checkpoint, its export) for a model with the padded vocabulary of
    training, whose padding rows hold values an exporter that kept them would give away."""
    tmp = tmp_path_factory.mktemp("export")
    model = make_tiny_gpt(vocab_size=50304)
    with torch.no_grad():
        model.lm_head.weight[N_VOCAB:] = 5.0
    ckpt = save_as_checkpoint(model, tmp / "ckpt_000010.pt")
    export_hf.main([ckpt, str(tmp / "hf")])
    return model, ckpt, str(tmp / "hf")


@pytest.mark.slow
def test_export_gives_our_logits_with_the_vocabulary_unpadded(padded):
    model, _, out = padded
    written = sorted(os.listdir(out))
    assert written == ["config.json", "generation_config.json", "merges.txt", "model.safetensors", "tokenizer.json",
                       "tokenizer_config.json", "vocab.json"]
    with open(os.path.join(REPO, "docs", "export.md"), encoding="utf-8") as f:
        documented = f.read().split("\n\n")[2]  # the paragraph under the command
    assert "seven files" in documented and all(f"`{name}`" in documented for name in written)
    assert sorted(os.listdir(os.path.dirname(out))) == ["ckpt_000010.pt", "hf"]  # no temporary left over
    assert os.stat(out).st_mode & 0o777 == 0o755
    assert all(os.stat(os.path.join(out, f)).st_mode & 0o777 == 0o644 for f in os.listdir(out))
    assert AutoTokenizer.from_pretrained(out).model_max_length == 64  # the block size
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.config.vocab_size == N_VOCAB and hf.lm_head.weight.shape == (N_VOCAB, 32)
    idx = torch.randint(0, N_VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
    assert diff < 1e-4


def test_exported_tokenizer_is_gpt2s(padded, tmp_path):
    out = padded[2]
    # The slow files alone (vocab.json, merges.txt) must give the same tokenizer as tokenizer.json.
    slow = tmp_path / "slow"
    slow.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(os.path.join(out, name), slow / name)
    with open(os.path.join(out, "merges.txt"), encoding="utf-8") as f:
        merges = f.read().splitlines()
    assert merges[:7] == ["#version: 0.2", "Ġ t", "Ġ a", "h e", "i n", "r e", "o n"] and len(merges) == 50001
    enc = get_encoding()
    for tok in (AutoTokenizer.from_pretrained(out), GPT2TokenizerFast.from_pretrained(out),
                GPT2TokenizerFast.from_pretrained(slow)):
        assert len(tok) == N_VOCAB and tok.eos_token_id == EOT
        assert tok(HELLO).input_ids == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
        for text in TRICKY:
            ids = tok(text).input_ids
            assert ids == enc.encode_ordinary(text), text
            assert tok.decode(ids) == text
        assert tok("a<|endoftext|>b").input_ids == enc.encode("a<|endoftext|>b", allowed_special="all")


def test_pipeline_runs_offline_and_generates_like_ours(padded):
    model, _, out = padded
    generate = pipeline("text-generation", model=out, device="cpu")
    text = generate(HELLO, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    ids = get_encoding().encode_ordinary(HELLO)
    ours = model.generate(torch.tensor([ids]), 8, temperature=0)[0].tolist()
    assert text == get_encoding().decode(ours)


def test_hf_to_ours_to_hf_is_lossless(hf_gpt2_dir, tmp_path):
    # The model-level mapping, on a vocabulary of 128...
    hf, path = hf_gpt2_dir
    sd = GPT.from_pretrained(path).to_hf_state_dict()
    assert sd.keys() == hf.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in hf.state_dict().items())
    # ... and the whole script, on GPT-2's vocabulary.
    hf = make_hf_gpt2(vocab_size=N_VOCAB)
    hf.save_pretrained(tmp_path / "original")
    export_hf.main([str(tmp_path / "original"), str(tmp_path / "exported")])
    again = GPT2LMHeadModel.from_pretrained(tmp_path / "exported").state_dict()
    assert again.keys() == hf.state_dict().keys()
    assert all(torch.equal(again[k], v) for k, v in hf.state_dict().items())


def error_of(capsys, argv):
    return exit_message(capsys, export_hf.main, *argv)


def test_bad_inputs_are_one_line_errors_and_leave_nothing(padded, tmp_path, monkeypatch, capsys):
    _, ckpt, _ = padded
    out = tmp_path / "out"
    assert error_of(capsys, [str(tmp_path / "missing.pt"), str(out)]).endswith("missing.pt: no such checkpoint")
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(open(ckpt, "rb").read()[:5000])
    assert "damaged or incomplete checkpoint" in error_of(capsys, [str(damaged), str(out)])
    small = save_as_checkpoint(make_tiny_gpt(vocab_size=128), tmp_path / "small.pt")
    assert "a vocabulary of 128 cannot hold GPT-2's 50257 token ids" in error_of(capsys, [small, str(out)])
    # A failure half way through the export leaves no out_dir and no temporary.
    def disk_full(out_dir, _):
        open(os.path.join(out_dir, "vocab.json"), "w").close()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_hf, "write_tokenizer", disk_full)
    assert "No space left on device" in error_of(capsys, [ckpt, str(out)])
    assert "No space left on device" in error_of(capsys, [ckpt, str(tmp_path / "new" / "deeper" / "out")])  # nor parents
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["damaged.pt", "small.pt"]
    # An existing non-empty out_dir is refused, untouched, unless --force.
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "exists and is not empty (use --force" in error_of(capsys, [ckpt, str(out)])
    assert os.listdir(out) == ["keep.txt"]
    export_hf.main([ckpt, str(out), "--force"])
    assert "keep.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)


def test_export_loads_back_into_our_model(padded):
    model, _, out = padded
    back = load_model(out).eval()
    idx = torch.randint(0, N_VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back(idx)[0] - model(idx)[0]).abs().max() < 1e-5


def test_forced_export_that_fails_leaves_the_old_directory(padded, tmp_path, monkeypatch, capsys):
    _, ckpt, _ = padded
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    def mismatch(model, out_dir):
        raise RuntimeError("the exported model's logits differ from the source's by 1.00e+00")
    monkeypatch.setattr(export_hf, "check_export", mismatch)
    assert "logits differ" in error_of(capsys, [ckpt, str(out), "--force"])
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["keep.txt"]


def test_an_export_that_disagrees_with_its_source_is_refused(padded, tmp_path, monkeypatch, capsys):
    _, ckpt, _ = padded
    # An activation other than GPT-2's: the weights load, the logits differ.
    gpt2_config = export_hf.hf_config
    def relu_config(config):
        hf = gpt2_config(config)
        hf.activation_function = "relu"
        return hf
    monkeypatch.setattr(export_hf, "hf_config", relu_config)
    assert "logits differ from the source's" in error_of(capsys, [ckpt, str(tmp_path / "a")])
    monkeypatch.undo()
    # A tokenizer without GPT-2's first merge ("Ġ t"): " to" no longer becomes one token.
    vocab, merges = export_hf.gpt2_vocab_and_merges()
    monkeypatch.setattr(export_hf, "gpt2_vocab_and_merges", lambda: (vocab, merges[1:]))
    assert "tokenizer disagrees with tiktoken" in error_of(capsys, [ckpt, str(tmp_path / "b")])
    assert os.listdir(tmp_path) == []


# Random bytes that torch's weights-only unpickler fails on as UnpicklingError, IndexError and KeyError.
RANDOM_BYTES_SEED = {"random pytorch_model.bin": 0, "random pytorch_model.bin, IndexError": 2,
                     "random pytorch_model.bin, KeyError": 20}


def damage(directory, kind):
    """Damages a saved Hugging Face GPT-2 directory as a failed download, a bad disk or an attacker would."""
    weights = directory / "model.safetensors"
    if kind.startswith("wpe stored as"):  # transformers would load it as 0s and 1s, or whole numbers
        from safetensors.torch import load_file, save_file
        tensors = load_file(weights)
        dtype = torch.bool if kind.endswith("BOOL") else torch.int8
        tensors["transformer.wpe.weight"] = (10 * tensors["transformer.wpe.weight"]).to(dtype)
        if "pytorch_model.bin" in kind:
            weights.unlink()
            torch.save(tensors, directory / "pytorch_model.bin")
        else:
            save_file(tensors, weights, metadata={"format": "pt"})
    elif kind == "truncated safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif "pytorch_model.bin" in kind:
        weights.unlink()
        payload = random.Random(RANDOM_BYTES_SEED.get(kind)).randbytes(4096)
        if kind.startswith("malicious"):
            import pickle

            class Payload:
                def __reduce__(self):
                    return (os.system, (f"touch {directory / 'ran'}",))
            payload = pickle.dumps(Payload())
        (directory / "pytorch_model.bin").write_bytes(payload)
    elif kind == "n_head 0":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "n_head": 0}))
    elif kind == "a NaN weight":
        from safetensors.torch import load_file, save_file
        tensors = load_file(weights)
        tensors["transformer.h.1.mlp.c_fc.weight"][0, 0] = float("nan")
        save_file(tensors, weights, metadata={"format": "pt"})


@pytest.mark.parametrize("kind, expected", [
    ("truncated safetensors", "cannot load {dir}/model.safetensors: Error while deserializing header"),
    ("random pytorch_model.bin", "{dir}/pytorch_model.bin: refused: not plain tensors"),
    ("random pytorch_model.bin, IndexError", "{dir}/pytorch_model.bin: refused: not plain tensors"),
    ("random pytorch_model.bin, KeyError", "{dir}/pytorch_model.bin: refused: not plain tensors"),
    ("malicious pytorch_model.bin", "{dir}/pytorch_model.bin: refused: not plain tensors"),
    ("n_head 0", "cannot load {dir}: config.json: n_head must be a positive integer, not 0"),
    ("a NaN weight", "{dir}: transformer.h.1.mlp.c_fc.weight holds NaN or infinite values"),
    ("wpe stored as BOOL", "cannot load {dir}: {dir}/model.safetensors: transformer.wpe.weight is stored as BOOL, "
                           "not a float dtype"),
    ("wpe stored as I8", "cannot load {dir}: {dir}/model.safetensors: transformer.wpe.weight is stored as I8, "
                         "not a float dtype"),
    ("wpe stored as I8 in pytorch_model.bin", "cannot load {dir}: {dir}/pytorch_model.bin: transformer.wpe.weight is "
                                              "stored as torch.int8, not a float dtype"),
])
def test_a_damaged_hugging_face_directory_is_one_line_in_every_script(hf_gpt2_dir, tmp_path, capsys, kind, expected):
    import hellaswag
    import sample
    from helpers.files import EXAMPLES, write_jsonl

    directory = tmp_path / "damaged"
    shutil.copytree(hf_gpt2_dir[1], directory)
    damage(directory, kind)
    expected = expected.format(dir=directory)
    for script, argv in ((export_hf, [directory, tmp_path / "out"]), (sample, ["--model", directory]),
                         (hellaswag, ["-m", directory, "--data", write_jsonl(tmp_path / "mini.jsonl", EXAMPLES)])):
        message = exit_message(capsys, script.main, *argv, *(["--device", "cpu"] if script is not export_hf else []))
        assert expected in message, (script.__name__, message)
    assert not (directory / "ran").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("n_layer, held", [(1_000_000, "blocks 0 to 1"), (3, "blocks 0 to 1"), (1, "blocks 0 to 1")])
def test_a_config_that_does_not_fit_the_weights_is_one_line_before_anything_is_built(hf_gpt2_dir, tmp_path, n_layer,
                                                                                    held):
    """config.json's n_layer of 1,000,000 beside 2 blocks' weights: transformers would build a
    million blocks (200 s of silence) before it found out; a sample.py bounded to 60 s and 2 GiB
    says so in one line."""
    from helpers.processes import one_line_error, run_bounded

    directory = tmp_path / "hf"
    shutil.copytree(hf_gpt2_dir[1], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "n_layer": n_layer}))
    expected = (f"cannot load {directory}: {directory / 'model.safetensors'}: config.json's n_layer is {n_layer:,}, "
                f"but its weights hold {held}")
    if n_layer == 1_000_000:
        message = one_line_error(run_bounded("sample.py", "--model", directory, "--device", "cpu"))
        assert message == f"sample.py: error: {expected}"
    else:
        with pytest.raises(CheckpointError) as e:
            load_model(str(directory))
        assert str(e.value) == expected


def test_the_export_writes_the_models_dropout_as_gpt2s_three_pdrops(tmp_path):
    """A checkpoint trained at --dropout 0.1 exports with pdrops of 0.1; one of none, with 0."""
    for dropout in (0.1, 0.0):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=4, n_embd=32, dropout=dropout))
        export_hf.main([save_as_checkpoint(model, tmp_path / f"{dropout}.pt"), str(tmp_path / str(dropout))])
        config = GPT2LMHeadModel.from_pretrained(tmp_path / str(dropout)).config
        assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (dropout, dropout, dropout)
