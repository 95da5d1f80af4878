"""Greedy generation with a Hugging Face Llama on breakgraph: the worked example of docs/transformers.md.

A Llama-3.2-1B-shaped model with random weights (built from a config: no
download), its attention switched to breakgraph's with one line, its decode
step captured per batch size by breakgraph.hf.Generator, then generation.
It prints the tokens and times each phase on its own:

- capture: every batch size up to --batch, once per process;
- prefill: the prompts' forward, which gives the first new token;
- decode: the other new tokens, one graph replay each.

Prefill and decode are timed the first time this process runs them (cold)
and again (warm). In breakable mode a cold decode step attends over a key
length the process has not seen before, so whatever the attention kernel
prepares for a new shape is paid then, once per length and batch size
(full mode attends over the whole cache at every step). The runner's
report follows. Without a GPU it says so and runs a 2-layer model of the
same family eagerly.

    python3 examples/llama_generate.py [--batch 4] [--prompt 128] [--new 128] [--mode breakable|full]
"""

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from breakgraph import hf

TINY = dict(hf.LLAMA_3_2_1B, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def at_least(minimum: int, meaning: str):
    """An argparse type: a whole number no smaller than ``minimum``, refused in the option's words."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} ({meaning}), got {value}")
        return value

    return parse


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=at_least(1, "prompts generated side by side"), default=4, help="prompts generated side by side (4)")
    parser.add_argument("--prompt", type=at_least(1, "tokens in each prompt"), default=128, help="tokens in each prompt (128)")
    parser.add_argument(
        "--new", type=at_least(2, "the prefill makes the first new token, decode steps the rest"), default=128, help="new tokens per prompt (128)"
    )
    parser.add_argument("--mode", choices=["breakable", "full"], default="breakable", help="the runner's graph mode (breakable)")
    return parser.parse_args()


def main() -> None:
    args = parse_arguments()
    gpu = torch.cuda.is_available()
    if not gpu:
        print("no CUDA GPU: a 2-layer Llama runs eagerly (the Generator's eager path); nothing is captured")
    torch.manual_seed(0)
    with torch.device("cuda" if gpu else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**(hf.LLAMA_3_2_1B if gpu else TINY))).to(torch.bfloat16 if gpu else torch.float32).eval()
    model.set_attn_implementation("breakgraph")  # the one line: attention becomes a breakgraph break
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device=model.device)

    def timed(fn):
        """Seconds ``fn()`` takes, its GPU work included; and what it returns."""
        if gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = fn()
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - started, result

    generator = hf.Generator(model, max_length=args.prompt + args.new, max_batch_size=args.batch, mode=args.mode)
    capture_s, _ = timed(generator.capture)  # every batch size up to --batch (1, 2, 4, ...), largest first
    # One new token is the prefill alone; the rest of a generation is decode.
    prefill_cold, _ = timed(lambda: generator.generate(prompts, 1))
    first_s, tokens = timed(lambda: generator.generate(prompts, args.new))  # this process's first decode
    prefill_warm, _ = timed(lambda: generator.generate(prompts, 1))
    again_s, _ = timed(lambda: generator.generate(prompts, args.new))
    decode_cold, decode_warm = first_s - prefill_warm, again_s - prefill_warm

    steps = args.new - 1
    print(f"row 0, first 16 new tokens: {tokens[0, args.prompt : args.prompt + 16].tolist()}")
    if gpu:
        print(f"capture, batch sizes up to {args.batch}: {capture_s:.2f} s")
    print(f"prefill, {args.batch} x {args.prompt} prompt tokens: {prefill_cold * 1e3:.1f} ms the first time, {prefill_warm * 1e3:.1f} ms warm")
    print(
        f"decode, {args.batch} x {steps} tokens: the first time {decode_cold:.2f} s ({args.batch * steps / decode_cold:.0f} tokens/s, "
        f"{decode_cold / steps * 1e3:.2f} ms a step); warm {decode_warm:.2f} s ({args.batch * steps / decode_warm:.0f} tokens/s, "
        f"{decode_warm / steps * 1e3:.2f} ms a step)"
    )
    print(f"the first generation in this process, capture included: {capture_s + prefill_cold + decode_cold:.2f} s")
    generator.runner.report()


if __name__ == "__main__":
    main()
