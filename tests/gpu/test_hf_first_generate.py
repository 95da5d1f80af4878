"""The first generate() at new lengths costs about what the next does: the break's attention builds no
cuDNN plan per key length; and the user's cuDNN attention setting is as it was after generate().

The timing runs in a fresh process per mode (cuDNN keeps the plans it built for the process):
``python -m tests.gpu.test_hf_first_generate MODE`` prints the seconds of a warm-up generate() at
other lengths, then of the first and the second at the timed lengths.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from benchmarks.transformers_generate import build_model
from breakgraph import hf

ROOT = Path(__file__).resolve().parents[2]
MODES = ["breakable", "full"]
SHAPE = dict(hf.LLAMA_3_2_1B, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64)
BATCH, PROMPT, NEW = 4, 128, 64


def timed_generate(generator: hf.Generator, prompt: int, new: int) -> float:
    """Seconds of one generate() of fresh prompts, with no end tokens: every call makes all ``new`` tokens."""
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, prompt), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = generator.generate(ids, new, eos_token_id=())
    torch.cuda.synchronize()
    assert tokens.shape == (BATCH, prompt + new)
    return time.perf_counter() - start


def warm_up_first_and_second(mode: str) -> tuple[float, float, float]:
    """Seconds of generate() calls of a captured Generator: a warm-up at key lengths the timed calls
    never reach (it pays what any first call pays: CUDA loading kernels on first use, the allocator
    growing), then the first and the second with a PROMPT-token prompt and NEW new tokens."""
    model = build_model(SHAPE, torch.bfloat16)
    model.set_attn_implementation(hf.ATTENTION)
    generator = hf.Generator(model, max_length=PROMPT + NEW, max_batch_size=BATCH, mode=mode, progress=False).capture()
    warm_up = timed_generate(generator, PROMPT // 2, 8)  # key lengths 64 to 71; the timed calls 128 to 191
    return warm_up, timed_generate(generator, PROMPT, NEW), timed_generate(generator, PROMPT, NEW)


@pytest.mark.parametrize("mode", MODES)
def test_the_first_generate_at_new_lengths_is_within_twice_the_second(mode):
    run = subprocess.run(
        [sys.executable, "-m", "tests.gpu.test_hf_first_generate", mode], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    warm_up, first, second = json.loads(run.stdout.strip().splitlines()[-1])
    print(
        f"{mode}: warm-up {warm_up * 1e3:.0f} ms; at {BATCH} x {PROMPT} prompt tokens and {NEW} new ones, "
        f"first generate() {first * 1e3:.0f} ms, second {second * 1e3:.0f} ms"
    )
    assert first <= 2 * second, f"{mode}: the first generate() at new lengths took {first:.3f} s, the second {second:.3f} s"


@pytest.fixture(scope="module")
def small_model():
    model = build_model(dict(SHAPE, num_hidden_layers=2), torch.bfloat16)
    model.set_attn_implementation(hf.ATTENTION)
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("user_setting", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_generate_leaves_the_user_s_cudnn_attention_setting(small_model, mode, user_setting):
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(user_setting)
    try:
        generator = hf.Generator(small_model, max_length=48, max_batch_size=2, mode=mode, progress=False)
        generator.generate(torch.randint(0, SHAPE["vocab_size"], (2, 16), device="cuda"), 16)
        assert torch.backends.cuda.cudnn_sdp_enabled() is user_setting
        generator.runner.release()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def cudnn_kernels(fn) -> list[str]:
    """Names of the CUDA kernels ``fn()`` launches that cuDNN's attention runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return sorted({event.name for event in profile.events() if "cudnn" in event.name.lower()})


def test_the_break_launches_no_cudnn_attention_where_sdpa_would(small_model):
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        # the decode step's attention as the break calls it: 4 key/value heads serving 4 queries each
        query = torch.randn(2, 4, 4, 64, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(2, 4, 37, 64, device="cuda", dtype=torch.bfloat16)
        if not cudnn_kernels(lambda: torch.nn.functional.scaled_dot_product_attention(query, keys, keys)):
            pytest.skip("torch's SDPA picks no cuDNN attention for a decode step on this GPU: nothing to exclude")
        generator = hf.Generator(small_model, max_length=48, max_batch_size=2, progress=False).capture()
        ids = torch.randint(0, SHAPE["vocab_size"], (2, 16), device="cuda")
        assert cudnn_kernels(lambda: generator.generate(ids, 16)) == []
        generator.runner.release()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


if __name__ == "__main__":
    print(json.dumps(warm_up_first_and_second(sys.argv[1])))
