"""Samples text from a model, printing each token as soon as it is generated.

    python sample.py --model log/ckpt_019073.pt --prompt "Hello, I'm a language model,"
    python sample.py --model gpt2 --prompt @prompt.txt --num_samples 1 --top_p 0.9

--model is anything load_model takes: a checkpoint of train_gpt2.py, a Hugging Face
GPT-2 directory (export_hf.py writes one), or gpt2 ... gpt2-xl. The samples come one
after another, each streamed as it grows; generation uses the model's KV cache.
"""
import argparse
import codecs
import sys

import torch

from cli import Parser, load_model_onto
from tokenizer import EOT, get_encoding


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Sample text from a GPT-2 model, streamed token by token.")
    parser.add_argument("--model", default="gpt2",
                        help="a checkpoint (log/ckpt_XXXXXX.pt), a Hugging Face GPT-2 directory, or gpt2 ... gpt2-xl")
    parser.add_argument("--prompt", default="Hello, I'm a language model,",
                        help="the text to continue, or @FILE to read it from FILE; empty starts a new document")
    parser.add_argument("--num_samples", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--top_k", type=int, default=50, help="sample from the k most likely tokens; 0 for all")
    parser.add_argument("--top_p", type=float, default=None,
                        help="sample from the fewest most likely tokens that hold this much probability")
    parser.add_argument("--seed", type=int, default=None, help="the same seed gives the same samples")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps, or auto: the best available")
    parser.add_argument("--stop_at_eot", action="store_true", help="end a sample at <|endoftext|>")
    args = parser.parse_args(argv)
    checks = [
        (args.num_samples >= 1, "--num_samples must be at least 1"),
        (args.max_new_tokens >= 1, "--max_new_tokens must be at least 1"),
        (args.temperature >= 0, "--temperature must be 0 (greedy) or more"),
        (args.top_k >= 0, "--top_k must be 0 (no limit) or more"),
        (args.top_p is None or 0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
        (args.seed is None or 0 <= args.seed < 2**64, "--seed must be in [0, 2**64)"),  # torch's seeds are 64-bit
    ]
    for ok, message in checks:
        if not ok:
            sys.exit(f"error: {message}")
    return args


def read_prompt(prompt):
    if not prompt.startswith("@"):
        return prompt
    try:
        with open(prompt[1:], encoding="utf-8", newline="") as f:  # as is: \r\n stays \r\n
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"error: --prompt {prompt}: {e}")


def sample_tokens(model, prompt_ids, args, generator):
    """The new token ids of one sample, each as soon as the model has sampled it."""
    idx = torch.tensor([prompt_ids], device=generator.device)
    top_k = args.top_k or None
    for token in model.generate_stream(idx, args.max_new_tokens, args.temperature, top_k, args.top_p, generator):
        token = token.item()
        if token == EOT and args.stop_at_eot:
            return
        yield token


def detokenize(tokens, enc):
    """Text for a stream of token ids, piece by piece. A character of several UTF-8 bytes may
    be split across tokens: its first bytes are held back until the rest arrive, and bytes
    that never make a valid character become U+FFFD, as in enc.decode."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in tokens:
        yield decoder.decode(enc.decode_single_token_bytes(token))
    yield decoder.decode(b"", final=True)


def main(argv=None):
    args = parse_args(argv)
    prompt = read_prompt(args.prompt)
    model, device = load_model_onto(Parser(prog="sample.py"), args.model, args.device)

    enc = get_encoding()
    # A prompt may hold <|endoftext|> to separate documents; an empty one starts a new document.
    prompt_ids = enc.encode(prompt, allowed_special="all") or [EOT]
    generator = torch.Generator(device)
    seed = args.seed if args.seed is not None else generator.seed()  # printed, so a run can be repeated
    generator.manual_seed(seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n_params / 1e6:.1f}M parameters on {device}, {len(prompt_ids)} prompt tokens, seed {seed}",
          file=sys.stderr)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}/{args.num_samples} ---", flush=True)
        print(prompt, end="", flush=True)
        for piece in detokenize(sample_tokens(model, prompt_ids, args, generator), enc):
            print(piece, end="", flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
