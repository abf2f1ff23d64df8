"""Generates text from a model, with Hugging Face's options: sampling, greedy search or beam
search, for one prompt or a file of them, run --batch_size prompts at a time.

    python sample.py --model log/ckpt_019073.pt --prompt "Hello, I'm a language model,"
    python sample.py --model gpt2 --prompt @prompt.txt --num_return_sequences 1 --top_p 0.9
    python sample.py --model gpt2 --prompts prompts.txt --decode beam --num_beams 4 --json out.json

--model is anything load_model takes: a checkpoint of train_gpt2.py, a Hugging Face
GPT-2 directory (export_hf.py writes one), or gpt2 ... gpt2-xl. Each prompt's results are
printed as soon as they are finished; generation uses the model's KV cache.
"""
if __name__ == "__main__":  # first: a Ctrl-C during the imports below, seconds long, is one line, not a traceback
    from gpt2repro.common.cli import exit_on_ctrl_c
    exit_on_ctrl_c()

import argparse
import sys
from dataclasses import asdict

import torch

from gpt2repro.common.cli import Parser
from gpt2repro.common.inputs import UnreadableFile, read_lines, read_text
from gpt2repro.lm.generate import GenerationConfig, generate_stream, left_pad
from gpt2repro.lm.tokenizer import EOT, get_encoding
from gpt2repro.runs.dcp_reader import CheckpointError
from gpt2repro.runs.loading import load_model_on

DECODE_NAMES = {"sampling": "sampling", "greedy": "greedy", "beam": "beam",
                "greedy_search": "greedy", "beam_search": "beam"}  # and PaddleFleetX's names


def build_parser():
    parser = Parser(prog="sample.py", description="Generate text from a GPT-2 model: sampling, greedy or beam search.")
    parser.add_argument("--model", default="gpt2",
                        help="a checkpoint (log/ckpt_XXXXXX.pt), a run's log directory (its newest checkpoint), "
                             "a Hugging Face GPT-2 directory, or gpt2 ... gpt2-xl")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="Hello, I'm a language model,",
                        help="the text to continue, or @FILE to read it from FILE; empty starts a new document")
    prompt.add_argument("--prompts", default=None, metavar="FILE",
                        help="a file of prompts, one a line, generated --batch_size at a time")
    parser.add_argument("--decode", choices=list(DECODE_NAMES), default=None,
                        help="default: beam with --num_beams 2 or more, else sampling")
    parser.add_argument("--num_return_sequences", "--num_samples", type=int, default=None,
                        help="outputs per prompt: samples, or the best beams (default: 4 samples, 1 beam)")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate after each prompt, at most")
    parser.add_argument("--min_new_tokens", type=int, default=0, help="<|endoftext|> is masked until this many tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling; 0 is greedy")
    parser.add_argument("--top_k", type=int, default=50, help="sample from the k most likely tokens; 0 for all")
    parser.add_argument("--top_p", type=float, default=None,
                        help="sample from the fewest most likely tokens that hold this much probability")
    parser.add_argument("--repetition_penalty", type=float, default=1.0,
                        help="CTRL's: above 1 makes tokens of the prompt and output less likely")
    parser.add_argument("--no_repeat_ngram_size", type=int, default=0, help="no n-gram of this size twice; 0 is off")
    parser.add_argument("--num_beams", type=int, default=1, help="beam search with this many beams; 1 is sampling or greedy")
    parser.add_argument("--length_penalty", type=float, default=1.0,
                        help="beam: a finished beam scores sum(log p) / length ** length_penalty")
    parser.add_argument("--early_stopping", type=early_stopping, default=False, metavar="{true,false,never}",
                        help="beam: stop a prompt once it has num_beams finished beams (true), once no beam can "
                             "improve at its length (false), or at the longest (never)")
    parser.add_argument("--stop_at_eot", action=argparse.BooleanOptionalAction, default=True,
                        help="end an output at <|endoftext|>")
    parser.add_argument("--seed", type=int, default=None,
                        help="the same seed gives the same samples; prompt i (from 0) of --prompts uses seed + i")
    parser.add_argument("--batch_size", type=int, default=16,
                        help="prompts generated at once, each as num_return_sequences rows (num_beams in beam "
                             "search); bounds memory, changes no result (default: 16)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps, or auto: the best available")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the settings and results here")
    return parser


def parse_args(parser, argv=None):
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch_size must be at least 1")
    if args.top_k < 0:
        parser.error("--top_k must be 0 (no limit) or more")
    if args.seed is not None and not 0 <= args.seed < 2**64:  # torch's seeds are 64-bit
        parser.error("--seed must be in [0, 2**64)")
    decode = DECODE_NAMES[args.decode] if args.decode else "beam" if args.num_beams > 1 else "sampling"
    try:
        args.config = GenerationConfig(
            decode=decode, max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
            temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p,
            repetition_penalty=args.repetition_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
            num_beams=args.num_beams, length_penalty=args.length_penalty, early_stopping=args.early_stopping,
            num_return_sequences=args.num_return_sequences if args.num_return_sequences is not None
            else 4 if decode == "sampling" else 1,
            eos_token_id=EOT if args.stop_at_eot else None)
    except ValueError as e:  # its message starts with the option's name, which is the flag's
        parser.error(f"--{e}")
    if args.json:
        parser.check_output("--json", args.json)
    return args


def early_stopping(text):
    values = {"true": True, "false": False, "never": "never"}
    if text.lower() not in values:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false or never")
    return values[text.lower()]


def read_prompt(prompt):
    """The prompt, or the file's text as is for @FILE (\r\n stays \r\n); inputs.read_text's errors."""
    return read_text(prompt[1:]) if prompt.startswith("@") else prompt


def read_prompts(path):
    """One prompt a line (\n, \r\n or \r); a blank line is an empty prompt, a last line break ends
    the last. inputs.read_lines's errors, and ValueError for an empty file."""
    prompts = [line for _, line in read_lines(path)]
    if not prompts:
        raise ValueError("the file is empty (one prompt a line)")
    return prompts


def encode_prompt(prompt):
    """A prompt's ids: it may hold <|endoftext|> to separate documents; an empty one starts a new document."""
    return get_encoding().encode(prompt, allowed_special="all") or [EOT]


def load_prompts(parser, flag, value):
    """The prompts of --prompts FILE or --prompt, or a one-line exit naming the file (and line)."""
    try:
        return read_prompts(value) if flag == "--prompts" else [read_prompt(value)]
    except UnreadableFile as e:  # its message starts with the file's path (and line): --prompt's @ goes before it
        parser.fail(f"{flag} {'@' if flag == '--prompt' else ''}{e}")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        parser.fail(f"{flag} {value}: {e}")


def check_lengths(parser, flag, value, lengths, block_size):
    """A one-line exit at the first prompt of more tokens (lengths) than block_size: the model
    could never read it whole, its start would be dropped unseen."""
    for i, n in enumerate(lengths):
        if n > block_size:
            where = (f"--prompts {value} line {i + 1}" if flag == "--prompts"
                     else f"--prompt {value}" if value.startswith("@") else "--prompt")
            parser.fail(f"{where}: a prompt of {n:,} tokens, longer than the model's context (block_size {block_size:,})")


def generate_batches(model, prompts, config, seed, batch_size, device):
    """Yields (i, outputs) for every prompt i, as generate_stream does for one batch, but runs
    batch_size prompts at a time, in input order: memory is bounded by the batch, not the file.
    Prompt i samples from its own generator, seeded seed + i, so its outputs are the same
    whichever prompts share its batch (greedy and beam search are so in any case)."""
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start: start + batch_size]
        idx, n_pad = left_pad([encode_prompt(prompt) for prompt in batch], EOT, device)
        generators = [torch.Generator(device).manual_seed((seed + i) % 2**64) for i in range(start, start + len(batch))]
        for i, outputs in generate_stream(model, idx, config, n_pad, generators):
            yield start + i, outputs


def print_result(i, n_prompts, prompt, texts, kind):
    """Prompt i's texts, each after the prompt, under a header where there are several."""
    for j, text in enumerate(texts):
        labels = [f"prompt {i + 1}/{n_prompts}"] * (n_prompts > 1) + [f"{kind} {j + 1}/{len(texts)}"] * (len(texts) > 1)
        if labels:
            print(f"--- {', '.join(labels)} ---")
        print(prompt + text, flush=True)


def main(argv=None):
    parser = build_parser()
    args = parse_args(parser, argv)
    config = args.config
    flag, value = ("--prompts", args.prompts) if args.prompts is not None else ("--prompt", args.prompt)
    prompts = load_prompts(parser, flag, value)
    try:
        model, device = load_model_on(args.model, args.device)
    except CheckpointError as e:
        parser.fail(str(e))

    enc = get_encoding()
    # Only the lengths are kept: as Python ints, every prompt's ids at once could take gigabytes.
    lengths = [len(encode_prompt(prompt)) for prompt in prompts]
    check_lengths(parser, flag, value, lengths, model.config.block_size)
    seed = args.seed if args.seed is not None else torch.Generator().seed()  # printed, so a run can be repeated
    n_params = sum(p.numel() for p in model.parameters())
    tokens = f"{min(lengths)}" if min(lengths) == max(lengths) else f"{min(lengths)}-{max(lengths)}"
    print(f"{args.model}: {n_params / 1e6:.1f}M parameters on {device}, {len(prompts)} prompt(s) of {tokens} tokens, "
          f"{config.decode}, seed {seed}", file=sys.stderr)

    results = [None] * len(prompts)  # kept for --json only
    for i, outputs in generate_batches(model, prompts, config, seed, args.batch_size, device):
        # The text is what the model wrote: without the <|endoftext|> that ended it (the ids keep it).
        texts = [enc.decode(ids[:-1] if config.eos_token_id is not None and ids[-1] == EOT else ids) for ids in outputs]
        print_result(i, len(prompts), prompts[i], texts, "beam" if config.decode == "beam" else "sample")
        if args.json:
            results[i] = {"prompt": prompts[i], "outputs": texts, "output_ids": outputs}
    if args.json:
        parser.write_json(args.json, {"settings": {"model": args.model, **asdict(config), "seed": seed},
                                      "results": results}, "the results are above")


if __name__ == "__main__":
    main()
