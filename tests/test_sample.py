"""sample.py: streamed, seeded, KV-cached sampling that never emits a padding id."""
import pytest
import torch

import sample
from conftest import exit_message, make_tiny_gpt, run_script, save_as_checkpoint
from tokenizer import EOT, N_VOCAB, get_encoding

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
    """What sample.py should print: each sample drawn in turn from one generator."""
    ids = torch.tensor([get_encoding().encode_ordinary(prompt)])
    out = ""
    for i in range(n_samples):
        new = model.generate(ids, max_new_tokens, generator=generator, **sampling)[0, ids.size(1):].tolist()
        assert max(new) < N_VOCAB
        header = f"--- sample {i + 1}/{n_samples} ---\n" if n_samples > 1 else ""
        out += header + prompt + get_encoding().decode_bytes(new).decode("utf-8", errors="replace") + "\n"
    return out


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


def test_a_prompt_file_is_read_as_is(tmp_path):
    (tmp_path / "prompt.txt").write_bytes(b"Dear Sir,\r\n\r\nold Mac line\rend\n")
    assert sample.read_prompt(f"@{tmp_path / 'prompt.txt'}") == "Dear Sir,\r\n\r\nold Mac line\rend\n"


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
    assert capsys.readouterr().out == "Hi" + "<|endoftext|>" * 3 + "\n"
    sample.main(flags + ["--stop_at_eot"])
    assert capsys.readouterr().out == "Hi\n"


def test_streaming_holds_back_partial_characters():
    enc = get_encoding()
    text = "日本語 🤖🎉 ünïcödé"
    tokens = enc.encode_ordinary(text)
    assert any(not is_utf8(enc.decode_single_token_bytes(t)) for t in tokens)  # some token splits a character
    pieces = list(sample.detokenize(tokens, enc))
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    # Bytes that never complete a character come out as U+FFFD, as from enc.decode.
    robot = enc.encode_ordinary("🤖")
    assert "".join(sample.detokenize(robot[:1] + enc.encode_ordinary("a"), enc)) == enc.decode(robot[:1] + [64])
    assert "".join(sample.detokenize(robot[:1], enc)) == enc.decode(robot[:1]) == "\ufffd"  # cut off at the end


def is_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("flags, message", [
    (["--num_samples", "0"], "error: --num_samples must be at least 1"),
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
    assert capsys.readouterr().out == prompt + get_encoding().decode(new) + "\n"


def test_a_model_without_gpt2s_vocabulary_is_a_one_line_error(tmp_path, capsys):
    ckpt = save_as_checkpoint(make_tiny_gpt(vocab_size=128), tmp_path / "small.pt")
    assert exit_message(capsys, sample.main, "--model", ckpt, "--device", "cpu") == (
        f"sample.py: error: {ckpt}: a vocabulary of 128 cannot hold GPT-2's 50257 token ids")
