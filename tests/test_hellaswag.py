"""hellaswag.py: the scoring method, batching, the rank split, the data checks, the CLI. Offline."""
import copy
import dataclasses
import json
import os
import re
import urllib.error
import urllib.request

import pytest
import torch
from torch.nn import functional as F

import hellaswag
from gpt2repro.common import cli
from gpt2repro.common.inputs import MAX_LINE_CHARS
from gpt2repro.lm.tokenizer import N_VOCAB, get_encoding
from gpt2repro.runs.loading import load_model
from hellaswag import HellaSwagError, ScoringConfig, count_correct, load_examples, read_examples, score_batches
from helpers.files import EXAMPLES, never_ending_inputs, write_jsonl
from helpers.limits import disk_full
from helpers.models import make_hf_gpt2
from helpers.processes import exit_message, run_bounded, run_script
from model import GPT, GPTConfig

@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return read_examples(write_jsonl(tmp_path_factory.mktemp("data") / "mini.jsonl", EXAMPLES))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Hugging Face GPT-2 with GPT-2's real vocabulary, so real token ids fit."""
    path = tmp_path_factory.mktemp("hf") / "tiny_gpt2"
    make_hf_gpt2(n_layer=2, n_head=2, n_embd=16, block_size=128, vocab_size=N_VOCAB).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny(hf_dir):
    return load_model(hf_dir).eval()


def all_scores(model, examples, batch_size):
    """(sum, mean) losses, (n, 4) each, in the order of examples."""
    sums, means = torch.zeros(len(examples), 4), torch.zeros(len(examples), 4)
    for keys, s, m in score_batches(model, examples, "cpu", batch_size):
        i, j = torch.tensor(keys).T
        sums[i, j], means[i, j] = s, m
    return sums, means


@torch.no_grad()
def reference_score(model, ctx, end):
    """One ending scored alone, unpadded: the sum and mean of -log p(ending token | all before it)."""
    tokens = torch.tensor(ctx + end)
    logprobs = model(tokens[None, :-1])[0][0].log_softmax(dim=-1)
    losses = torch.stack([-logprobs[len(ctx) + i - 1, t] for i, t in enumerate(end)])
    return losses.sum().item(), losses.mean().item()


def test_batched_scores_equal_unbatched_and_the_definition(tiny, examples):
    enc = get_encoding()
    sums, means = all_scores(tiny, examples, batch_size=1)
    for batch_size in (2, 3, 16):  # uneven last batches, and all examples in one padded batch
        s, m = all_scores(tiny, examples, batch_size)
        assert torch.allclose(s, sums, rtol=1e-5, atol=1e-5) and torch.allclose(m, means, rtol=1e-5, atol=1e-5)
    for i, e in enumerate(examples):
        ctx = enc.encode_ordinary(e["ctx"])
        for j, ending in enumerate(e["endings"]):
            expected = reference_score(tiny, ctx, enc.encode_ordinary(" " + ending))
            assert (sums[i, j].item(), means[i, j].item()) == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_the_logits_chunk_is_sized_by_device(monkeypatch):
    """A CPU's chunk stays in its caches; a GPU's is 1 GiB, hundreds of positions a matmul at
    GPT-2's vocabulary, unless less than 8 GiB is free."""
    assert hellaswag.logits_per_chunk(torch.device("cpu")) * 4 == 16 << 20
    for free, chunk_bytes in [(80 << 30, 1 << 30), (4 << 30, 512 << 20)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 80 << 30))
        assert hellaswag.logits_per_chunk(torch.device("cuda:0")) * 4 == chunk_bytes
    assert hellaswag.logits_per_chunk(torch.device("cuda:0")) // 50304 > 1000 // 2


def test_scores_do_not_depend_on_the_logits_chunk(tiny, examples, monkeypatch):
    monkeypatch.setattr(hellaswag, "logits_per_chunk", lambda device: 10**9)  # every batch's logits at once
    whole = all_scores(tiny, examples, batch_size=16)
    monkeypatch.setattr(hellaswag, "logits_per_chunk", lambda device: 3 * tiny.config.vocab_size)  # 3 positions a chunk
    chunked = all_scores(tiny, examples, batch_size=16)
    for a, b in zip(whole, chunked):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bfloat16_scores_keep_the_head_in_float32(tiny, examples):
    """GPT-2's logits lie near -60, where bfloat16 rounds to steps of 0.25: rounded there, the
    losses of endings would be off by more than the differences that rank them."""
    model = copy.deepcopy(tiny)
    with torch.no_grad():  # every logit moved by -60 (a constant hidden unit): no loss changes
        model.transformer.ln_f.weight[0], model.transformer.ln_f.bias[0] = 0.0, 1.0
        model.lm_head.weight[:, 0] = -60.0
    rows = [row for e in examples for row in hellaswag.example_rows(e, model.config.block_size)]
    _, exact = hellaswag.ending_losses(model, rows, "cpu", torch.float32)
    _, bf16 = hellaswag.ending_losses(model, rows, "cpu", torch.bfloat16)
    assert (bf16 - exact).abs().max() < 2e-3  # the body's bf16 noise; rounded logits gave 7e-2 here


def test_bfloat16_parameters_as_fsdp_gathers_them_still_get_a_float32_head(tiny, examples):
    """Under FSDP with bf16 parameters the gathered head weight is bf16 while the hidden states
    are float32: the head upcasts the weight rather than failing or rounding the logits."""
    model = copy.deepcopy(tiny).to(torch.bfloat16)
    rows = [row for e in examples for row in hellaswag.example_rows(e, model.config.block_size)]
    total, _ = hellaswag.ending_losses(model, rows, "cpu", torch.bfloat16)
    with torch.no_grad():
        hidden = model.hidden_states(hellaswag.make_batch(rows, "cpu")[0]).float()
        logits = F.linear(hidden, model.lm_head.weight.float())[..., : model.n_tokens]
    targets = hellaswag.make_batch(rows, "cpu")[1]
    expected = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-1, reduction="none").sum(dim=1)
    assert torch.allclose(total, expected, rtol=1e-5)


def test_long_rows_keep_the_ending_and_drop_context_from_the_left():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=N_VOCAB, n_layer=1, n_head=2, n_embd=16)).eval()
    enc = get_encoding()
    # A context of 45 tokens, endings of 1 to 6.
    example = {"ctx": EXAMPLES[2]["ctx"], "endings": ["a b", "Water the ceiling.", "Plants do not like pots.", "c"], "label": 1}
    sums, means = all_scores(model, [example], batch_size=1)
    ctx = enc.encode_ordinary(example["ctx"])
    for j, ending in enumerate(example["endings"]):
        end = enc.encode_ordinary(" " + ending)
        kept = ctx[-(17 - len(end)):]  # the model reads 16 tokens: all but the last of 17
        assert (sums[0, j].item(), means[0, j].item()) == pytest.approx(reference_score(model, kept, end), rel=1e-5)
    too_long = dict(example, endings=["word " * 20] * 4)
    with pytest.raises(ValueError, match="does not fit block_size 16"):
        all_scores(model, [too_long], batch_size=1)


def unigram_model(token_logits):
    """A GPT whose next-token logits are token_logits at every position, whatever came before:
    every weight zero but the final LayerNorm's bias (e_0) and column 0 of the tied embedding."""
    model = GPT(GPTConfig(block_size=32, vocab_size=N_VOCAB, n_layer=1, n_head=1, n_embd=4)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[:, 0] = token_logits
    return model


def test_sum_and_mean_pick_as_defined():
    enc = get_encoding()
    endings = ["slept", "ate some fish quickly", "ran away from home", "purred"]
    ids = [enc.encode_ordinary(" " + e) for e in endings]
    assert [len(t) for t in ids] == [1, 4, 4, 2]
    token_logits = torch.zeros(N_VOCAB)
    token_logits[ids[1]] = torch.tensor([6.0, 5.0, 6.5, 5.5])  # likely tokens, but four of them
    token_logits[ids[3][0]] = 3.0
    model = unigram_model(token_logits)
    # Each token costs logsumexp - its logit: the short unlikely ending has the lowest sum,
    # the long likely one the lowest mean.
    z = token_logits.logsumexp(0)
    expected_sum = torch.stack([(z - token_logits[t]).sum() for t in ids])
    expected_mean = expected_sum / torch.tensor([len(t) for t in ids])
    assert expected_sum.argmin() == 0 and expected_mean.argmin() == 1
    ctx = "The cat sat on the mat. The cat"
    examples = [{"ctx": ctx, "endings": endings, "label": 0}, {"ctx": ctx, "endings": endings, "label": 1}]
    sums, means = all_scores(model, examples, batch_size=2)
    assert torch.allclose(sums, expected_sum.expand(2, 4), atol=1e-4)
    assert torch.allclose(means, expected_mean.expand(2, 4), atol=1e-4)
    # Label 0 is right by the sum only, label 1 by the mean only.
    assert count_correct(model, examples[:1], ScoringConfig("cpu")) == {"n": 1, "correct": 1, "correct_norm": 0}
    assert count_correct(model, examples[1:], ScoringConfig("cpu")) == {"n": 1, "correct": 0, "correct_norm": 1}
    # Over several batches (rows go longest first, so both examples finish in the last one).
    assert count_correct(model, examples, ScoringConfig("cpu", batch_size=1)) == {"n": 2, "correct": 1,
                                                                                  "correct_norm": 1}


def test_rank_shares_add_up_to_the_whole(tiny, examples):
    whole = count_correct(tiny, examples, ScoringConfig("cpu", batch_size=2))
    shares = [count_correct(tiny, examples, ScoringConfig("cpu", batch_size=2), rank=r, world_size=2) for r in range(2)]
    assert [s["n"] for s in shares] == [3, 2]
    assert {k: shares[0][k] + shares[1][k] for k in whole} == whole
    # Each share is exactly its examples: rank 1 holds examples 1 and 3.
    assert shares[1] == count_correct(tiny, [examples[1], examples[3]], ScoringConfig("cpu"))


def test_scoring_prints_progress_lines_where_no_terminal_shows_a_bar(tiny, examples, monkeypatch, capsys):
    from gpt2repro.common import progress
    monkeypatch.setattr(progress, "PROGRESS_EVERY", 0)  # a line at every batch
    counts = count_correct(tiny, examples, ScoringConfig("cpu", batch_size=2, progress=True))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3 and all(re.match(r"hellaswag: \d/5 ex \(\d+%\), [\d.,]+ ex/s", line) for line in lines)
    assert lines[-1].startswith("hellaswag: 5/5 ex (100%)")
    assert lines[-1].endswith(f"acc_norm={counts['correct_norm'] / 5:.4f}")
    assert "left" in lines[0] and "left" not in lines[-1]


def test_labels_may_be_ints_or_digit_strings(examples):
    assert [e["label"] for e in examples] == [2, 0, 1, 3, 0]
    assert all(type(e["label"]) is int for e in examples)


@pytest.mark.parametrize("line, message", [
    ('{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 0', "not valid JSON"),
    ('{"ctx": "A man", "label": 0}', "missing field 'endings'"),
    ('{"ctx": "A man", "endings": ["a", "b", "c"], "label": 0}', "endings must be a list of 4 non-empty strings"),
    ('{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 4}', "label must be 0 to 3"),
    ('{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": "x"}', "label must be 0 to 3"),
    ('{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": true}', "label must be 0 to 3"),
    pytest.param('{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": "' + "7" * 100_000 + '"}',
                 "label must be 0 to 3 (an int or a digit string), not '7777777777777777777777777777777777777777'... "
                 "(100,000 characters)", id="label-of-100000-characters"),
    ('{"ctx": "", "endings": ["a", "b", "c", "d"], "label": 0}', "ctx must be a non-empty string"),
    ('[1, 2]', "not a JSON object"),
    ('{"ctx": "A man \\ud800", "endings": ["a", "b", "c", "d"], "label": 0}',
     "ctx holds '\\ud800', a lone surrogate: not Unicode text"),
    ('{"ctx": "A man", "endings": ["a", "b", "\\udfff c", "d"], "label": 0}',
     "ending 2 holds '\\udfff', a lone surrogate: not Unicode text"),
    pytest.param('{"ctx": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deep to read (thousands of levels)",
                 id="nested-100000-deep"),
])
def test_malformed_lines_are_named(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [EXAMPLES[0], line, EXAMPLES[1]])
    with pytest.raises(HellaSwagError, match=re.escape(f"{path} line 2: {message}")):
        load_examples(path)


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A local folder standing in for the download URL."""
    folder = tmp_path / "mirror"
    folder.mkdir()
    monkeypatch.setenv("HELLASWAG_URL", folder.as_uri())
    return folder


def test_download_replaces_a_corrupt_cache_and_checks_the_count(tmp_path, mirror, capsys):
    good = [dict(EXAMPLES[i % 5], ind=i) for i in range(10042)]
    write_jsonl(mirror / "hellaswag_val.jsonl", good)
    cache = tmp_path / "cache"
    cache.mkdir()
    # A download cut off mid-line: reported, fetched again, and the good copy scored.
    partial = (mirror / "hellaswag_val.jsonl").read_bytes()[:50_000]
    assert not partial.endswith(b"\n")
    (cache / "hellaswag_val.jsonl").write_bytes(partial)
    loaded = load_examples(cache_dir=str(cache))
    assert len(loaded) == 10042 and loaded[7]["label"] == EXAMPLES[2]["label"]
    err = capsys.readouterr().err
    cut_line = partial.count(b"\n") + 1
    assert f"line {cut_line}: not valid JSON" in err and "downloading it again" in err
    assert os.listdir(cache) == ["hellaswag_val.jsonl"]  # no temporary file left behind
    # A good cached file is used as it is, network or not.
    (mirror / "hellaswag_val.jsonl").unlink()
    assert len(load_examples(cache_dir=str(cache))) == 10042
    # A complete download of the wrong size is refused.
    write_jsonl(mirror / "hellaswag_val.jsonl", EXAMPLES[:3])
    (cache / "hellaswag_val.jsonl").unlink()
    with pytest.raises(HellaSwagError, match=re.escape(f"{cache / 'hellaswag_val.jsonl'}: 3 examples, expected 10042")):
        load_examples(cache_dir=str(cache))
    with pytest.raises(HellaSwagError, match="test split's labels are not public"):
        load_examples(split="test", cache_dir=str(cache))


def test_download_only_fetches_the_split_once_and_later_runs_need_no_network(tiny, tmp_path, mirror, capsys):
    write_jsonl(mirror / "hellaswag_val.jsonl", [dict(EXAMPLES[i % 5], ind=i) for i in range(10042)])
    cache = tmp_path / "cache"
    hellaswag.main(["--download_only", "--cache_dir", str(cache)])  # no -m: no model is loaded, gpt2's neither
    assert capsys.readouterr().out.splitlines()[-1] == f"{cache / 'hellaswag_val.jsonl'}: 10,042 examples, checked"
    (mirror / "hellaswag_val.jsonl").unlink()  # offline from here on
    ckpt = save_train_checkpoint(tiny, tmp_path / "ckpt.pt")
    hellaswag.main(["-m", ckpt, "--cache_dir", str(cache), "--limit", "3", "--device", "cpu"])
    assert "3 examples, acc" in capsys.readouterr().out
    message = exit_message(capsys, hellaswag.main, "--download_only", "--data", tmp_path / "x.jsonl")
    assert message == "hellaswag.py: error: --download_only fetches --split; --data is a local copy already (see --help)"


def test_a_failed_download_leaves_nothing_behind(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError("Temporary failure in name resolution")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(HellaSwagError, match="--download_only`, or pass --data PATH"):
        load_examples(cache_dir=str(tmp_path / "hellaswag"))
    assert os.listdir(tmp_path) == []
    with pytest.raises(HellaSwagError, match="pass --hellaswag_path PATH"):
        load_examples(cache_dir=str(tmp_path / "hellaswag"), local_flag="--hellaswag_path")


def test_download_only_offline_says_where_a_copy_goes_not_to_run_itself(tmp_path, monkeypatch, capsys):
    def offline(url, timeout):
        raise urllib.error.URLError("Temporary failure in name resolution")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    cache = tmp_path / "hellaswag"
    message = exit_message(capsys, hellaswag.main, "--download_only", "--cache_dir", cache)
    assert message.endswith(f"(Temporary failure in name resolution); run this where there is a network, "
                            f"or copy hellaswag_val.jsonl into {cache}")
    assert "python hellaswag.py --download_only" not in message


@pytest.mark.parametrize("model, error", [
    ("log/ckpt_missing.pt", "log/ckpt_missing.pt: no such checkpoint"),
    ("log_nothere", "no such checkpoint or directory 'log_nothere' (and not a GPT-2 model name: gpt2, gpt2-medium, "
                    "gpt2-large, gpt2-xl)"),
    ("empty", "empty: a directory with neither checkpoints (ckpt_XXXXXX.pt, or ckpt_XXXXXX/ sharded) nor a "
              "Hugging Face GPT-2 model (config.json) in it")])
def test_a_model_path_that_is_wrong_is_the_error_before_any_download(tmp_path, monkeypatch, capsys, model, error):
    def no_download(url, timeout):
        raise AssertionError(f"downloaded {url}")
    monkeypatch.setattr(urllib.request, "urlopen", no_download)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert exit_message(capsys, hellaswag.main, "-m", model, "--cache_dir", tmp_path / "cache") == (
        f"hellaswag.py: error: {error}")


def save_train_checkpoint(model, path, vocab_size=N_VOCAB):
    """The weights of model as train_gpt2.py saves them, optionally in a vocabulary padded for speed."""
    cfg = dataclasses.replace(model.config, vocab_size=vocab_size)
    padded = GPT(cfg)
    sd = padded.state_dict()
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key in ("transformer.wte.weight", "lm_head.weight"):
                sd[key][:N_VOCAB] = tensor
                sd[key][N_VOCAB:] = 100.0  # padding rows that would win every softmax, were they not sliced off
            else:
                sd[key].copy_(tensor)
    torch.save({"model": sd, "config": dataclasses.asdict(cfg), "step": 0}, path)
    return str(path)


def test_a_checkpoint_scores_as_the_same_weights_from_a_hugging_face_dir(tiny, examples, tmp_path):
    expected = all_scores(tiny, examples, batch_size=4)
    for vocab_size in (N_VOCAB, 50304):
        path = save_train_checkpoint(tiny, tmp_path / f"ckpt_{vocab_size}.pt", vocab_size)
        scores = all_scores(load_model(path).eval(), examples, batch_size=4)
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(scores, expected))


def run_cli(*args, env=None):
    return run_script("hellaswag.py", *args, env=env)


@pytest.mark.slow
def test_cli_scores_local_data_and_writes_json(tiny, examples, tmp_path):
    data = write_jsonl(tmp_path / "mini.jsonl", EXAMPLES)
    ckpt = save_train_checkpoint(tiny, tmp_path / "ckpt.pt")
    out = tmp_path / "result.json"
    proc = run_cli("-m", ckpt, "--data", data, "--json", str(out), "--device", "cpu", "--batch_size", "2", "--limit", "4")
    assert proc.returncode == 0, proc.stderr
    expected = count_correct(tiny, examples[:4], ScoringConfig("cpu"))
    result = json.loads(out.read_text())
    assert result == {**expected, "acc": expected["correct"] / 4, "acc_norm": expected["correct_norm"] / 4}
    assert f"acc_norm {result['acc_norm']:.4f} ({expected['correct_norm']}/4)" in proc.stdout


def test_cli_whose_json_cannot_be_written_after_scoring_says_so_in_one_line(tiny, examples, tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.setattr(cli, "atomic_open", disk_full)
    out = tmp_path / "result.json"
    message = exit_message(capsys, hellaswag.main, "-m", save_train_checkpoint(tiny, tmp_path / "ckpt.pt"), "--data",
                           write_jsonl(tmp_path / "mini.jsonl", EXAMPLES), "--json", out, "--device", "cpu")
    assert message == f"hellaswag.py: error: --json {out}: cannot write it (No space left on device); the result is above"
    assert not out.exists()


def test_cli_refuses_what_it_cannot_score_or_write_before_scoring(tiny, tmp_path, capsys, monkeypatch):
    data = write_jsonl(tmp_path / "mini.jsonl", EXAMPLES)
    models = {}
    for name, config in [("small_vocab", GPTConfig(vocab_size=256, n_layer=1, n_head=1, n_embd=8, block_size=128)),
                         ("short_block", GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=16))]:
        models[name] = tmp_path / f"{name}.pt"
        torch.save({"model": GPT(config).state_dict(), "config": dataclasses.asdict(config)}, models[name])

    def error(*argv):
        return exit_message(capsys, hellaswag.main, *argv)
    assert error("-m", models["small_vocab"], "--data", data, "--device", "cpu") == (
        f"hellaswag.py: error: {models['small_vocab']}: a vocabulary of 256 cannot hold GPT-2's 50257 token ids")
    enc = get_encoding()
    too_long = next(n for e in EXAMPLES for ending in e["endings"] if (n := len(enc.encode_ordinary(" " + ending))) > 16)
    assert error("-m", models["short_block"], "--data", data, "--device", "cpu") == (
        f"hellaswag.py: error: {models['short_block']}: an ending of {too_long} tokens does not fit block_size 16")
    (tmp_path / "file").write_text("")
    ckpt = save_train_checkpoint(tiny, tmp_path / "ckpt.pt")
    line = error("-m", ckpt, "--data", data, "--json", tmp_path / "file" / "out.json")
    assert line.startswith(f"hellaswag.py: error: --json {tmp_path / 'file' / 'out.json'}: cannot write there")
    assert error("-m", ckpt, "--cache_dir", tmp_path / "file" / "cache").startswith("hellaswag.py: error: could not download")
    monkeypatch.setenv(hellaswag.URL_ENV, "mirror")
    line = error("-m", ckpt, "--cache_dir", tmp_path / "cache")
    assert line.startswith("hellaswag.py: error: could not download mirror/hellaswag_val.jsonl")


@pytest.mark.slow
def test_cli_without_network_or_data_fails_in_one_line(tmp_path):
    proc = run_cli("--cache_dir", str(tmp_path / "empty"),
                   env={"HELLASWAG_URL": (tmp_path / "unreachable").as_uri()})
    assert proc.returncode != 0
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("hellaswag.py: error: could not download") and "--data" in line
    assert not os.path.exists(tmp_path / "empty")


def test_a_local_mirror_whose_file_is_a_fifo_is_one_line_never_a_wait(tmp_path):
    """A file: URL's file is read only if it is a regular file: a FIFO would wait for a writer forever."""
    os.mkfifo(tmp_path / "hellaswag_val.jsonl")
    proc = run_script("hellaswag.py", "--download_only", "--cache_dir", tmp_path / "cache",
                      env={"HELLASWAG_URL": tmp_path.as_uri()}, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"hellaswag.py: error: could not download {tmp_path.as_uri()}/hellaswag_val.jsonl ({tmp_path}/hellaswag_val.jsonl: "
        f"a FIFO, not a regular file); run this where there is a network, or copy hellaswag_val.jsonl into "
        f"{tmp_path / 'cache'}"]
    assert not os.path.exists(tmp_path / "cache")


def test_an_ending_fits_with_one_context_token_and_no_fewer():
    def words(n):
        return " ".join(["word"] * n)  # " word" is one token
    rows = hellaswag.example_rows(dict(EXAMPLES[0], endings=[words(16)] * 4), 16)
    assert all(len(tokens) == 17 and start == 1 for tokens, start in rows)
    with pytest.raises(ValueError, match="an ending of 17 tokens does not fit block_size 16"):
        hellaswag.example_rows(dict(EXAMPLES[0], endings=[words(17)] * 4), 16)


def test_cli_acc_is_by_the_sum_and_acc_norm_by_the_mean(tmp_path, capsys):
    # The case of test_sum_and_mean_pick_as_defined: ending 0 has the lowest sum, ending 1 the lowest mean.
    enc = get_encoding()
    endings = ["slept", "ate some fish quickly", "ran away from home", "purred"]
    token_logits = torch.zeros(N_VOCAB)
    token_logits[enc.encode_ordinary(" " + endings[1])] = torch.tensor([6.0, 5.0, 6.5, 5.5])
    token_logits[enc.encode_ordinary(" " + endings[3])[0]] = 3.0
    ckpt = save_train_checkpoint(unigram_model(token_logits), tmp_path / "ckpt.pt")
    example = {"ctx": "The cat sat on the mat. The cat", "endings": endings}
    data = write_jsonl(tmp_path / "data.jsonl", [dict(example, label=0)] * 3 + [dict(example, label=1)])
    hellaswag.main(["-m", ckpt, "--data", data, "--json", str(tmp_path / "out.json"), "--device", "cpu"])
    result = json.loads((tmp_path / "out.json").read_text())
    assert (result["correct"], result["correct_norm"], result["acc"], result["acc_norm"]) == (3, 1, 0.75, 0.25)
    assert "acc 0.7500 (3/4), acc_norm 0.2500 (1/4)" in capsys.readouterr().out


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text("\n" + json.dumps(EXAMPLES[0]) + "\n\n" + json.dumps(EXAMPLES[1]) + "\n  \n", encoding="utf-8")
    assert [e["label"] for e in read_examples(str(path))] == [2, 0]


@pytest.mark.slow
@pytest.mark.parametrize("name, why", [("/dev/zero", ": a device, not a regular file"),
                                       ("fifo", ": a FIFO, not a regular file"),
                                       ("dir", ": a directory, not a regular file"),
                                       ("huge", " line 1: more than 524,288 characters")])
def test_data_that_never_ends_is_refused_in_one_line(tmp_path, name, why):
    path = never_ending_inputs(tmp_path)[name]
    proc = run_bounded("hellaswag.py", "--data", path, "--device", "cpu")
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", f"hellaswag.py: error: {path}{why}\n")


def test_a_line_may_hold_max_line_chars_and_no_more(tmp_path):
    line = json.dumps(EXAMPLES[0])
    padded = line + " " * (MAX_LINE_CHARS - len(line))  # JSON allows the spaces
    path = write_jsonl(tmp_path / "long.jsonl", [EXAMPLES[1], padded])
    assert [e["label"] for e in read_examples(path)] == [0, 2]
    path = write_jsonl(tmp_path / "longer.jsonl", [EXAMPLES[1], padded + " ", EXAMPLES[2]])
    with pytest.raises(HellaSwagError, match=f"^{re.escape(path)} line 2: more than 524,288 characters$"):
        read_examples(path)
