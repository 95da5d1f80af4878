"""Greedy generation with a Hugging Face Llama on breakgraph: the README's worked example.

A Llama-3.2-1B-shaped model with random weights (built from a config: no
download), its attention switched to breakgraph's with one line, its decode
step captured per batch size by breakgraph.hf.Generator, then generation:
prints the tokens, the time to capture, the decode speed, and the runner's
report. Without a GPU it says so and runs a 2-layer model of the same
family eagerly.

    python3 examples/llama_generate.py [--batch 4] [--prompt 128] [--new 128] [--mode breakable|full]
"""

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from breakgraph import hf

TINY = dict(hf.LLAMA_3_2_1B, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--mode", choices=["breakable", "full"], default="breakable")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if not gpu:
        print("no CUDA GPU: a 2-layer Llama runs eagerly (the Generator's eager path); nothing is captured")
    torch.manual_seed(0)
    with torch.device("cuda" if gpu else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**(hf.LLAMA_3_2_1B if gpu else TINY))).to(torch.bfloat16 if gpu else torch.float32).eval()
    model.set_attn_implementation("breakgraph")  # the one line: attention becomes a breakgraph break

    generator = hf.Generator(model, max_length=args.prompt + args.new, max_batch_size=args.batch, mode=args.mode)
    started = time.perf_counter()
    generator.capture()  # every batch size up to --batch (1, 2, 4, ...), largest first
    if gpu:
        print(f"captured in {time.perf_counter() - started:.2f} s")

    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device=model.device)
    generator.generate(prompts, 2)  # first replays
    if gpu:
        torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = generator.generate(prompts, args.new)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    print(f"row 0, first 16 new tokens: {tokens[0, args.prompt : args.prompt + 16].tolist()}")
    print(f"{args.batch} x {args.new} tokens in {seconds:.2f} s: {args.batch * args.new / seconds:.0f} tokens/s (prefill included)")
    generator.runner.report()


if __name__ == "__main__":
    main()
