"""Shared checks: compare replay with eager on fresh random inputs, with poisoned outputs."""

from __future__ import annotations

import torch

import breakgraph as bg
from breakgraph.recording import op_watch


@bg.eager_on_graph
def scale_eager(x, factor=2.0):
    return x * factor


@bg.eager_on_graph
def softmax_eager(x):
    return torch.softmax(x, dim=-1)


def poison_(value) -> None:
    """Fill every floating tensor in ``value`` with NaN so an unwritten buffer shows."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            value.fill_(float("nan"))
    elif isinstance(value, (list, tuple)):
        for item in value:
            poison_(item)
    elif isinstance(value, dict):
        for item in value.values():
            poison_(item)


def assert_close(actual, expected, atol=1e-5, rtol=1e-5) -> None:
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, atol, rtol)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_close(actual[key], expected[key], atol, rtol)
    else:
        assert actual == expected


def check_against_eager(fn, static_inputs, trials: int = 3, atol=1e-5, rtol=1e-5, **capture_kwargs):
    """Capture ``fn(*static_inputs)``, then for fresh random inputs compare replay with eager.

    Returns the graph. Outputs are poisoned before every replay.
    """
    graph = bg.BreakableCUDAGraph()
    with torch.no_grad():
        for _ in range(1):  # warm up library handles outside the capture
            fn(*static_inputs)
        torch.cuda.synchronize()
        with bg.BreakableCUDAGraphCapture(graph, **capture_kwargs):
            out = fn(*static_inputs)
        for _ in range(trials):
            fresh = [torch.randn_like(x) for x in static_inputs]
            for static, new in zip(static_inputs, fresh):
                static.copy_(new)
            poison_(out)
            graph.replay()
            torch.cuda.synchronize()
            assert_close(out, fn(*fresh), atol, rtol)
    return graph, out


@bg.eager_on_graph
def normalize(x):
    return x / x.norm(dim=-1, keepdim=True)


def normalized_model(x, w):
    """Three graph segments around two ``normalize`` breaks."""
    h = torch.relu(x @ w)
    h = normalize(h)
    return normalize(h @ w) + 1


def transformers_eager_generate(model, input_ids, new_tokens: int, **kwargs):
    """Greedy tokens from transformers' own eager generation (SDPA attention, its dynamic
    cache), exactly ``new_tokens`` of them; the model is left on breakgraph's attention."""
    model.set_attn_implementation("sdpa")
    try:
        return model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    finally:
        model.set_attn_implementation("breakgraph")


def tiny_llama():
    """A 2-layer Llama of 300 tokens with random weights, in eval mode on the CPU, with no end or
    pad token (generation runs every step asked for)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


def use_watch(monkeypatch, form: str) -> None:
    """Make this test's captures watch for random ops through ``form``: "dispatch mode" (the
    watch where a torch has no dispatch key to lend it), or else the dispatch key's kernels,
    also after another test compiled with torch.compile in this process (a capture that
    watches nothing, ``random_ops="error"``, is left as it is)."""
    if form == "dispatch mode":
        monkeypatch.setattr(op_watch._key_watch, "available", lambda: False)
    else:
        monkeypatch.setattr(op_watch, "dynamo_compiled", lambda: False)
