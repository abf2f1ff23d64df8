"""sample.py: seeded sampling, greedy and beam search, one prompt or a batch, never a padding id."""
import json
import os

import pytest
import torch

import sample
from gpt2repro.common import cli
from gpt2repro.lm import generate
from gpt2repro.lm.tokenizer import EOT, N_VOCAB, get_encoding
from helpers.files import never_ending_inputs
from helpers.limits import disk_full
from helpers.models import make_eot_gpt, make_tiny_gpt, save_as_checkpoint
from helpers.processes import exit_message, run_bounded, run_script

PROMPT = "Once upon a time, ünïcödé"


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """(model, checkpoint) of a padded-vocabulary model whose padding rows would win every
    argmax if they were not cut off: every hidden state leans on ln_f's bias, and the
    padding rows point along it."""
    model = make_tiny_gpt(vocab_size=50304)
    with torch.no_grad():
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[N_VOCAB:] = 1.0
    idx = torch.tensor([get_encoding().encode_ordinary(PROMPT)])
    x = model.transformer.ln_f(model.transformer.wte(idx) + model.transformer.wpe(torch.arange(idx.size(1))))
    assert (model.lm_head(x).argmax(-1) >= N_VOCAB).all()  # the padding does dominate
    return model, save_as_checkpoint(model, tmp_path_factory.mktemp("sample") / "ckpt_000010.pt")


def expected_output(model, prompt, n_samples, max_new_tokens, generator, **sampling):
    """What sample.py should print: the samples of one prompt, drawn together from one generator."""
    ids = torch.tensor([get_encoding().encode_ordinary(prompt)])
    out = model.generate(ids, max_new_tokens, generator=generator, num_return_sequences=n_samples, eos_token_id=EOT,
                         **sampling)
    text = ""
    for i, row in enumerate(out[:, ids.size(1):].tolist()):
        new = generate.until_eos(row, EOT)
        assert max(new) < N_VOCAB
        header = f"--- sample {i + 1}/{n_samples} ---\n" if n_samples > 1 else ""
        text += header + prompt + get_encoding().decode(new[:-1] if new[-1] == EOT else new) + "\n"
    return text


@pytest.mark.slow
def test_seeded_samples_repeat_and_read_the_prompt_from_a_file(padded, tmp_path, capsys):
    model, ckpt = padded
    (tmp_path / "prompt.txt").write_text(PROMPT, encoding="utf-8")
    # All 50257 ids in play at temperature 1: many a token is part of a character.
    flags = ["--model", ckpt, "--num_samples", 2, "--max_new_tokens", 24, "--top_k", 0, "--seed", 7, "--device", "cpu"]
    from_file = run_script("sample.py", *flags, "--prompt", "@prompt.txt", cwd=tmp_path)
    assert from_file.returncode == 0, from_file.stderr
    sample.main([*map(str, flags), "--prompt", PROMPT])  # a second run, in this process
    expected = expected_output(model, PROMPT, 2, 24, torch.Generator().manual_seed(7), temperature=1.0, top_k=None)
    assert from_file.stdout == capsys.readouterr().out == expected


def test_a_runs_log_dir_samples_its_newest_checkpoint_and_says_which(padded, tmp_path, capsys):
    model, ckpt = padded
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    save_as_checkpoint(make_tiny_gpt(seed=1), log_dir / "ckpt_000005.pt")  # an older one, another model
    (log_dir / "ckpt_000010.pt").write_bytes(open(ckpt, "rb").read())
    flags = ["--decode", "greedy", "--num_return_sequences", "1", "--max_new_tokens", "8", "--device", "cpu"]
    sample.main(["--model", ckpt, *flags])
    expected = capsys.readouterr().out
    sample.main(["--model", str(log_dir), *flags])
    out, err = capsys.readouterr()
    assert out == expected
    assert err.splitlines()[0] == f"{log_dir}: loading its newest checkpoint, {log_dir / 'ckpt_000010.pt'}"
    (tmp_path / "empty").mkdir()
    assert exit_message(capsys, sample.main, "--model", tmp_path / "empty", *flags) == (
        f"sample.py: error: {tmp_path / 'empty'}: a directory with neither checkpoints (ckpt_XXXXXX.pt, or "
        f"ckpt_XXXXXX/ sharded) nor a Hugging Face GPT-2 model (config.json) in it")


def test_a_mistyped_run_folder_is_one_line_at_once_without_asking_the_hub(tmp_path, capsys, monkeypatch):
    """A bare name that is no path and not GPT-2's is a typo, not a hub model: no probe of the hub."""
    from gpt2repro.runs import loading

    def probe(*args, **kwargs):
        raise AssertionError("the hub was asked")
    monkeypatch.setattr(loading, "hub_unreachable", probe)
    monkeypatch.setattr(loading.GPT, "from_pretrained", probe)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        sample.main(["--model", "log_nothere"])
    assert capsys.readouterr().err == (
        "sample.py: error: no such checkpoint or directory 'log_nothere' (and not a GPT-2 model name: "
        "gpt2, gpt2-medium, gpt2-large, gpt2-xl)\n")
    assert exit_message(capsys, sample.main, "--model", "./log_nothere/") == (
        "sample.py: error: ./log_nothere/: no such file or directory")


def test_a_prompt_file_is_read_as_is(tmp_path):
    (tmp_path / "prompt.txt").write_bytes(b"Dear Sir,\r\n\r\nold Mac line\rend\n")
    assert sample.read_prompt(f"@{tmp_path / 'prompt.txt'}") == "Dear Sir,\r\n\r\nold Mac line\rend\n"


@pytest.mark.slow
def test_top_k_1_is_greedy_and_never_a_padding_id(padded):
    model, ckpt = padded
    result = run_script("sample.py", "--model", ckpt, "--prompt", PROMPT, "--num_samples", 1,
                        "--max_new_tokens", 30, "--top_k", 1, "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_output(model, PROMPT, 1, 30, None, temperature=0)


def test_stop_at_eot(padded, tmp_path, capsys):
    model, _ = padded
    with torch.no_grad():
        model = make_tiny_gpt(vocab_size=50304)
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[EOT] = 1.0  # <|endoftext|> wins every argmax
    ckpt = save_as_checkpoint(model, tmp_path / "eot.pt")
    flags = ["--model", ckpt, "--prompt", "Hi", "--num_samples", "1", "--top_k", "1", "--max_new_tokens", "3"]
    sample.main(flags)
    assert capsys.readouterr().out == "Hi\n"
    sample.main(flags + ["--no-stop_at_eot"])
    assert capsys.readouterr().out == "Hi" + "<|endoftext|>" * 3 + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--num_samples", "0"], "error: --num_return_sequences must be in [1, 1024]"),
    (["--decode", "beam"], "error: --num_beams must be 2 or more for beam search"),
    (["--num_beams", "4", "--num_return_sequences", "5"], "error: --num_return_sequences 5 is more than num_beams 4"),
    (["--decode", "greedy_search", "--num_beams", "4"], "error: --num_beams is for beam search only"),
    (["--decode", "greedy", "--num_samples", "2"], "error: --num_return_sequences must be 1 in greedy search"),
    (["--repetition_penalty", "0"], "error: --repetition_penalty must be in [0.001, 1000]"),
    (["--no_repeat_ngram_size", "-2"], "error: --no_repeat_ngram_size must be 0 (off) or more"),
    (["--min_new_tokens", "-1"], "error: --min_new_tokens must be 0 or more"),
    (["--max_new_tokens", "0"], "error: --max_new_tokens must be in [1, 65536]"),
    (["--prompts", "no/such/prompts.txt"], "error: --prompts no/such/prompts.txt: [Errno 2]"),
    (["--json", "."], "error: --json .: cannot write there (a directory, not a regular file)"),
    (["--temperature", "-1"], "error: --temperature must be 0 (greedy) or more"),
    (["--top_k", "-5"], "error: --top_k must be 0 (no limit) or more"),
    (["--top_p", "0"], "error: --top_p must be in (0, 1]"),
    (["--seed", "99999999999999999999999"], "error: --seed must be in [0, 2**64)"),
    (["--seed", "-1"], "error: --seed must be in [0, 2**64)"),
    (["--prompt", "@no/such/prompt.txt"], "error: --prompt @no/such/prompt.txt: [Errno 2]"),
    (["--device", "nonsense"], "error: --device nonsense:"),
    (["--model", "no/such/ckpt_000100.pt"], "error: no/such/ckpt_000100.pt: no such checkpoint"),
])
def test_bad_flags_are_one_line_errors(flags, message, capsys):
    assert message in exit_message(capsys, sample.main, *flags)


@pytest.mark.parametrize("flags, message", [
    (["--length_penalty", "nan"], "--length_penalty must be in [-10, 10]"),
    (["--length_penalty", "inf"], "--length_penalty must be in [-10, 10]"),
    (["--num_beams", "2", "--length_penalty=-inf"], "--length_penalty must be in [-10, 10]"),
    (["--num_beams", "4", "--length_penalty", "1e308"], "--length_penalty must be in [-10, 10]"),
    (["--num_beams", "1000000000000"], "--num_beams must be at most 1024"),
    (["--num_return_sequences", "1000000000000"], "--num_return_sequences must be in [1, 1024]"),
    (["--repetition_penalty", "1e-308"], "--repetition_penalty must be in [0.001, 1000]"),
    (["--min_new_tokens", "201"], "--min_new_tokens 201 is more than max_new_tokens 200"),
    (["--min_new_tokens", "5", "--max_new_tokens", "4"], "--min_new_tokens 5 is more than max_new_tokens 4"),
    (["--batch_size", "0"], "--batch_size must be at least 1"),
    # Beam search's hypotheses, of every length up to it, would take 16 GB, then 2**63 positions (tracebacks);
    # sampling 2**64 tokens, with the window sliding past the context, would never end.
    (["--num_beams", "2", "--max_new_tokens", "1000000000"], "--max_new_tokens must be in [1, 65536]"),
    (["--num_beams", "2", "--max_new_tokens", str(2**63 - 1)], "--max_new_tokens must be in [1, 65536]"),
    (["--max_new_tokens", str(2**64)], "--max_new_tokens must be in [1, 65536]"),
])
def test_flags_out_of_range_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        sample.main(flags)
    assert (e.value.code, *capsys.readouterr()) == (2, "", f"sample.py: error: {message} (see --help)\n")


def test_temperature_and_top_p_reach_the_sampler(padded, capsys):
    model, ckpt = padded
    sample.main(["--model", ckpt, "--prompt", PROMPT, "--num_samples", "1", "--max_new_tokens", "8", "--top_k", "0",
                 "--temperature", "0.5", "--top_p", "0.5", "--seed", "3", "--device", "cpu"])
    expected = expected_output(model, PROMPT, 1, 8, torch.Generator().manual_seed(3),
                               temperature=0.5, top_k=None, top_p=0.5)
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("prompt", ["", "<|endoftext|>"])
def test_an_empty_prompt_starts_a_document_like_endoftext(padded, prompt, capsys):
    model, ckpt = padded
    sample.main(["--model", ckpt, "--prompt", prompt, "--num_samples", "1", "--max_new_tokens", "8",
                 "--temperature", "0", "--device", "cpu"])
    new = model.generate(torch.tensor([[EOT]]), 8, temperature=0)[0, 1:].tolist()
    assert EOT not in new and capsys.readouterr().out == prompt + get_encoding().decode(new) + "\n"


def test_a_model_without_gpt2s_vocabulary_is_a_one_line_error(tmp_path, capsys):
    ckpt = save_as_checkpoint(make_tiny_gpt(vocab_size=128), tmp_path / "small.pt")
    assert exit_message(capsys, sample.main, "--model", ckpt, "--device", "cpu") == (
        f"sample.py: error: {ckpt}: a vocabulary of 128 cannot hold GPT-2's 50257 token ids")


PROMPTS = ["The cat sat on", "Once upon a time, in a land far away, there lived", "", "Hi"]


@pytest.fixture(scope="module")
def eot_model(tmp_path_factory):
    """(model, checkpoint, prompts file) for a model that often ends its texts early."""
    tmp = tmp_path_factory.mktemp("batch")
    model = make_eot_gpt()
    (tmp / "prompts.txt").write_bytes("\r\n".join(PROMPTS).encode() + b"\n")  # any line ending; a last one
    return model, save_as_checkpoint(model, tmp / "eot.pt"), str(tmp / "prompts.txt")


@pytest.mark.parametrize("flags", [
    ["--num_samples", "2", "--temperature", "0.6", "--top_k", "20", "--top_p", "0.9"],
    ["--decode", "greedy", "--repetition_penalty", "1.3", "--no_repeat_ngram_size", "2"],
    ["--decode", "beam_search", "--num_beams", "3", "--num_return_sequences", "2", "--length_penalty", "0.5",
     "--early_stopping", "never", "--min_new_tokens", "2"],
])
def test_a_prompts_file_is_one_batch_whose_results_are_each_prompt_alone(eot_model, flags, tmp_path, capsys):
    _, ckpt, prompts_file = eot_model
    common = ["--model", ckpt, "--max_new_tokens", "8", "--device", "cpu", *flags]
    sample.main([*common, "--prompts", prompts_file, "--seed", "100", "--json", str(tmp_path / "batch.json")])
    batch = json.loads((tmp_path / "batch.json").read_text())
    assert [r["prompt"] for r in batch["results"]] == PROMPTS  # in input order, whatever finished first
    printed = capsys.readouterr().out
    for i, prompt in enumerate(PROMPTS):  # prompt i samples with seed 100 + i
        sample.main([*common, "--prompt", prompt, "--seed", str(100 + i), "--json", str(tmp_path / "alone.json")])
        alone = json.loads((tmp_path / "alone.json").read_text())["results"][0]
        assert alone == batch["results"][i]
        kind = "beam" if "beam_search" in flags else "sample"
        for j, text in enumerate(alone["outputs"]):
            header = f"--- prompt {i + 1}/{len(PROMPTS)}" + (f", {kind} {j + 1}/2" if len(alone["outputs"]) > 1 else "")
            assert f"{header} ---\n{prompt}{text}\n" in printed
    results = batch["results"]
    assert any(ids[-1] == EOT and len(ids) < 8 for r in results for ids in r["output_ids"])  # some ended early
    for r in results:
        assert [get_encoding().decode(ids[:-1] if ids[-1] == EOT else ids) for ids in r["output_ids"]] == r["outputs"]


def test_every_flag_reaches_generation_and_the_json_says_so(eot_model, tmp_path):
    model, ckpt, prompts_file = eot_model
    sample.main(["--model", ckpt, "--prompts", prompts_file, "--num_beams", "4", "--num_return_sequences", "3",
                 "--length_penalty", "-0.5", "--early_stopping", "true", "--min_new_tokens", "3", "--max_new_tokens",
                 "9", "--repetition_penalty", "1.2", "--no_repeat_ngram_size", "3", "--seed", "5",
                 "--json", str(tmp_path / "out.json")])
    report = json.loads((tmp_path / "out.json").read_text())
    config = generate.GenerationConfig(decode="beam", num_beams=4, num_return_sequences=3, length_penalty=-0.5,
                                       early_stopping=True, min_new_tokens=3, max_new_tokens=9, repetition_penalty=1.2,
                                       no_repeat_ngram_size=3, eos_token_id=EOT)
    assert report["settings"] == {"model": ckpt, **vars(config), "seed": 5}
    prompt_ids = [get_encoding().encode(p, allowed_special="all") or [EOT] for p in PROMPTS]
    idx, n_pad = generate.left_pad(prompt_ids, EOT)
    expected = dict(generate.generate_stream(model, idx, config, n_pad))
    assert [r["output_ids"] for r in report["results"]] == [expected[i] for i in range(len(PROMPTS))]


def test_results_are_printed_as_each_prompt_finishes(eot_model, capsys):
    model, ckpt, prompts_file = eot_model
    sample.main(["--model", ckpt, "--prompts", prompts_file, "--decode", "greedy", "--max_new_tokens", "8"])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--- prompt")]
    prompt_ids = [get_encoding().encode(p, allowed_special="all") or [EOT] for p in PROMPTS]
    config = generate.GenerationConfig(decode="greedy", max_new_tokens=8, eos_token_id=EOT)
    idx, n_pad = generate.left_pad(prompt_ids, EOT)
    finished = [i for i, _ in generate.generate_stream(model, idx, config, n_pad)]
    assert finished != sorted(finished)  # a later prompt finished first...
    assert printed == [f"--- prompt {i + 1}/{len(PROMPTS)} ---" for i in finished]  # ... and was printed first


def test_a_json_that_cannot_be_written_at_the_end_is_one_line_after_the_results(padded, tmp_path, monkeypatch, capsys):
    _, ckpt = padded
    monkeypatch.setattr(cli, "atomic_open", disk_full)
    with pytest.raises(SystemExit) as e:
        sample.main(["--model", ckpt, "--prompt", "Hi", "--num_samples", "1", "--max_new_tokens", "4",
                     "--json", str(tmp_path / "out.json")])
    printed = capsys.readouterr()
    assert e.value.code == 1 and printed.err.splitlines()[-1] == (
        f"sample.py: error: --json {tmp_path / 'out.json'}: cannot write it (No space left on device); "
        "the results are above")
    assert printed.out.startswith("Hi") and os.listdir(tmp_path) == []


def test_bad_prompt_files_and_flags_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    for prompts, message in [("empty.txt", "the file is empty (one prompt a line)"),
                             ("latin1.txt", "codec can't decode")]:
        error = exit_message(capsys, sample.main, "--prompts", tmp_path / prompts, "--device", "cpu")
        assert error.startswith(f"sample.py: error: --prompts {tmp_path / prompts}: ") and message in error
    for flags, message in [(["--prompt", "a", "--prompts", "p.txt"], "not allowed with argument"),
                           (["--early_stopping", "maybe"], "'maybe' is not true, false or never"),
                           (["--decode", "nucleus"], "invalid choice: 'nucleus'")]:
        with pytest.raises(SystemExit) as e:
            sample.main(flags)
        assert e.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("flag, name, why", [
    ("--prompts ", "/dev/zero", ": a device, not a regular file"),
    ("--prompts ", "fifo", ": a FIFO, not a regular file"),
    ("--prompts ", "dir", ": a directory, not a regular file"),
    ("--prompts ", "huge", " line 1: more than 524,288 characters"),
    ("--prompt @", "/dev/zero", ": a device, not a regular file"),
    ("--prompt @", "fifo", ": a FIFO, not a regular file"),
    ("--prompt @", "huge", ": more than 524,288 characters"),
])
def test_prompts_that_never_end_are_refused_in_one_line(tmp_path, flag, name, why):
    # Read before the model is loaded: the default gpt2, not on this machine, is never reached.
    path = never_ending_inputs(tmp_path)[name]
    proc = run_bounded("sample.py", *f"{flag}{path}".split(" "), "--device", "cpu")
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", f"sample.py: error: {flag}{path}{why}\n")


def test_a_prompt_longer_than_the_context_is_refused_in_one_line(padded, tmp_path, capsys):
    model, ckpt = padded
    assert model.config.block_size == 64
    fits, too_long = "word" + " word" * 63, "word" + " word" * 64  # " word" is one token
    assert len(get_encoding().encode_ordinary(too_long)) == 65
    (tmp_path / "prompts.txt").write_text(f"Hi\n{fits}\n{too_long}\nHo\n")
    (tmp_path / "prompt.txt").write_text(too_long)
    flags = ["--model", ckpt, "--decode", "greedy", "--max_new_tokens", "2", "--device", "cpu"]
    why = "a prompt of 65 tokens, longer than the model's context (block_size 64)"
    for prompt, where in [(["--prompts", tmp_path / "prompts.txt"], f"--prompts {tmp_path / 'prompts.txt'} line 3"),
                          (["--prompt", f"@{tmp_path / 'prompt.txt'}"], f"--prompt @{tmp_path / 'prompt.txt'}"),
                          (["--prompt", too_long], "--prompt")]:
        with pytest.raises(SystemExit) as e:
            sample.main([*flags, *map(str, prompt)])
        assert (e.value.code, *capsys.readouterr()) == (1, "", f"sample.py: error: {where}: {why}\n")
    sample.main([*flags, "--prompt", fits])  # a prompt of block_size tokens is read whole
    new = model.generate(torch.tensor([get_encoding().encode_ordinary(fits)]), 2, temperature=0)[0, 64:].tolist()
    assert capsys.readouterr().out == fits + get_encoding().decode(new) + "\n"


def printed_blocks(out):
    """{header: its texts} of sample.py's output for several prompts, whatever their order."""
    blocks = {}
    for line in out.splitlines(keepends=True):
        if line.startswith("--- prompt "):
            header = line
        blocks[header] = blocks.get(header, "") + line
    return blocks


@pytest.mark.parametrize("flags", [
    ["--num_samples", "2", "--temperature", "0.6", "--top_k", "20", "--top_p", "0.9"],
    ["--decode", "greedy", "--repetition_penalty", "1.3", "--no_repeat_ngram_size", "2"],
    ["--decode", "beam_search", "--num_beams", "3", "--num_return_sequences", "2", "--length_penalty", "0.5",
     "--early_stopping", "never", "--min_new_tokens", "2"],
])
def test_prompts_run_batch_size_at_a_time_with_the_results_of_one_batch(eot_model, flags, tmp_path, capsys,
                                                                         monkeypatch):
    _, ckpt, prompts_file = eot_model
    batches = []

    def spy(model, idx, config, n_pad, generators):
        batches.append(idx.size(0))
        return generate.generate_stream(model, idx, config, n_pad, generators)
    monkeypatch.setattr(sample, "generate_stream", spy)
    common = ["--model", ckpt, "--prompts", prompts_file, "--max_new_tokens", "8", "--seed", "100", "--device", "cpu",
              *flags]
    runs = {}
    for batch_size, expected_batches in [(None, [4]), (3, [3, 1])]:  # None: the default, 16
        batches.clear()
        json_path = tmp_path / f"{batch_size}.json"
        sample.main([*common, *["--batch_size", str(batch_size)] * (batch_size is not None), "--json", str(json_path)])
        assert batches == expected_batches
        runs[batch_size] = printed_blocks(capsys.readouterr().out), json_path.read_text()
    assert len(runs[None][0]) == len(PROMPTS) * (1 if "greedy" in flags else 2)
    assert runs[3] == runs[None]  # the same texts, and the same --json to the byte


@pytest.mark.slow
def test_a_file_of_200000_prompts_is_generated_16_at_a_time(padded, tmp_path, monkeypatch, capsys):
    # It was one batch: 200,000 rows (and generators), that ran out of memory.
    _, ckpt = padded
    n = 200_000
    (tmp_path / "prompts.txt").write_text("".join(f"prompt {i}\n" for i in range(n)))
    calls = []

    def generate_stream(model, idx, config, n_pad, generators):  # every output is <|endoftext|> at once
        calls.append((idx.size(0), len(generators)))
        return ((i, [[EOT]]) for i in range(idx.size(0)))
    monkeypatch.setattr(sample, "generate_stream", generate_stream)
    sample.main(["--model", ckpt, "--prompts", str(tmp_path / "prompts.txt"), "--num_samples", "1", "--device", "cpu"])
    assert calls == [(16, 16)] * (n // 16)
    assert capsys.readouterr().out == "".join(f"--- prompt {i + 1}/{n} ---\nprompt {i}\n" for i in range(n))
