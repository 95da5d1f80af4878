"""A Llama-3.2-1B-shaped transformers model generating through breakgraph.hf, against transformers' eager generation."""

import gc
import random
import weakref

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from torch._dynamo.utils import counters

from benchmarks.transformers_generate import build_model
from breakgraph import hf
from breakgraph.hf import LLAMA_3_2_1B
from tests.helpers import transformers_eager_generate

PROMPT, NEW = 128, 128
MODES = ["breakable", "full"]
# The Generators under test: each mode, and each with its decode step compiled by Inductor.
VARIANTS = {mode: dict(mode=mode) for mode in MODES} | {f"{mode} + compile": dict(mode=mode, compile=True) for mode in MODES}
VARIANTS["breakable + compile in background"] = dict(mode="breakable", compile=True, compile_in_background=True)


def fresh_prompts(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, LLAMA_3_2_1B["vocab_size"], (batch, length), device="cuda")


@pytest.fixture(scope="module")
def fp32_model():
    model = build_model(LLAMA_3_2_1B, torch.float32, seed=random.randrange(2**31))
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def fp32_generators(fp32_model):
    fp32_model.set_attn_implementation(hf.ATTENTION)
    counters.clear()
    generators = {
        variant: hf.Generator(fp32_model, max_length=PROMPT + NEW, max_batch_size=4, progress=False, **options).capture().wait_for_compile()
        for variant, options in VARIANTS.items()
    }
    generators["dynamo"] = {"graph breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}
    yield generators
    for variant in VARIANTS:
        generators[variant].runner.release()


def eager_logit_gaps(model, got, expected, column: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At the first column where the tokens differ, how far apart eager's logits put the two
    tokens in each differing row, and that row's largest logit. Inductor orders a compiled step's
    float32 reductions its own way, so of two tokens a random-weight model scores equal to
    rounding it may pick the other; past that column the generations continue different texts."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            logits = model(expected[:, :column]).logits[:, -1].float()
    finally:
        model.set_attn_implementation(hf.ATTENTION)
    rows = (got[:, column] != expected[:, column]).nonzero().flatten()
    gaps = (logits[rows, expected[rows, column]] - logits[rows, got[rows, column]]).abs()
    return gaps, logits[rows].abs().amax(dim=-1)


def assert_equal_or_tied(model, mode: str, got, expected, prompt: int, what: str = "") -> None:
    """``got`` (tokens, after ``prompt`` prompt tokens) equals eager's ``expected``, or, for a
    compiled variant, first differs where eager's logits tie the two tokens to rounding."""
    differs = (got != expected).any(dim=0).nonzero()
    if differs.numel():
        column = int(differs[0])
        gaps, largest = eager_logit_gaps(model, got, expected, column)
        tie = "compile" in mode and bool((gaps <= 1e-3 * largest).all())  # compiled float32 may break a tie the other way
        assert tie, (
            f"{mode}{what}: first differing column {column - prompt} of {got.shape[1] - prompt} new tokens; "
            f"eager's logits differ there by {gaps.tolist()} (largest {largest.tolist()})"
        )


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mode", VARIANTS)
def test_float32_tokens_equal_transformers_eager(fp32_model, fp32_generators, mode, batch):
    ids = fresh_prompts(batch, PROMPT)
    expected = transformers_eager_generate(fp32_model, ids, NEW)
    got = fp32_generators[mode].generate(ids, NEW)
    assert got.shape == expected.shape == (batch, PROMPT + NEW)
    assert_equal_or_tied(fp32_model, mode, got, expected, PROMPT)
    report = fp32_generators[mode].runner.report(print_table=False)
    assert [row["size"] for row in report["rows"]] == [1, 2, 4]


def test_the_compiled_step_is_one_dynamo_graph_per_batch_kind(fp32_generators):
    """Attention is an op in Dynamo's graph, not a graph break, and no step's lengths are traced:
    one graph for batch 1 and one with the batch dynamic serve every size, step and mode, and
    the background compile's, on a twin cache and inputs, serve its Generator's own."""
    dynamo = fp32_generators["dynamo"]
    assert dynamo["graph breaks"] == {} and dynamo["graphs"] == 2, dynamo
    assert all(fp32_generators[variant].compiled == ("compile" in variant) for variant in VARIANTS)


def test_a_background_compile_serves_uncompiled_graphs_while_it_compiles_then_compiled_ones():
    shape = dict(LLAMA_3_2_1B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    model = build_model(shape, torch.float32, seed=random.randrange(2**31))  # a model of its own: nothing compiled for it yet
    model.set_attn_implementation(hf.ATTENTION)
    ids = torch.randint(0, shape["vocab_size"], (3, 32), device="cuda")
    expected = transformers_eager_generate(model, ids, 64)
    graphs = counters["stats"]["unique_graphs"]
    gen = hf.Generator(model, max_length=96, max_batch_size=4, progress=False, compile=True, compile_in_background=True)
    assert torch.equal(gen.generate(ids, 64), expected)  # captured uncompiled; the compile starts as it returns
    assert gen.compiling and not gen.compiled
    uncompiled = list(gen.runner.graphs.values())  # held, so that no graph captured later can take their place
    assert torch.equal(gen.generate(ids, 64), expected)  # served by the uncompiled graphs, Inductor compiling beside it
    gen.wait_for_compile()
    assert gen.compiled and sorted(gen.runner.graphs) == [(None, 4)]  # the size the calls needed
    assert not {id(graph) for graph in gen.runner.graphs.values()} & {id(graph) for graph in uncompiled}  # captured again
    assert torch.equal(gen.generate(ids, 64), expected)
    assert torch.equal(gen.generate(ids[:1], 64), expected[:1])  # size 1, captured compiled on this call
    assert sorted(gen.runner.graphs) == [(None, 1), (None, 4)]
    assert torch.equal(gen.generate(ids, 64, do_sample=True, top_k=1), expected)  # the sampling step, captured compiled
    assert counters["stats"]["unique_graphs"] - graphs == 2
    gen.runner.release()
    gen.sampling_runner.release()


@pytest.mark.parametrize("mode", VARIANTS)
def test_left_padded_rows_each_equal_their_own_generation(fp32_model, fp32_generators, mode):
    # 3 rows of 40, 17 and 1 prompt tokens (left-padded, as tokenizers pad), served by the size-4 graph
    lengths, width, new = [40, 17, 1], 40, 24
    ids = fresh_prompts(3, width)
    mask = torch.zeros(3, width, dtype=torch.long, device="cuda")
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    got = fp32_generators[mode].generate(ids, new, attention_mask=mask)
    for row, length in enumerate(lengths):
        alone = transformers_eager_generate(fp32_model, ids[row : row + 1, width - length :], new)
        assert torch.equal(got[row : row + 1, width - length : width], alone[:, :length])
        assert_equal_or_tied(fp32_model, mode, got[row : row + 1, width - length :], alone, length, f": row {row} ({length}-token prompt)")


def relative_difference(logits: torch.Tensor, expected: torch.Tensor) -> float:
    return float((logits.float() - expected.float()).abs().max() / expected.float().abs().max())


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_logits_within_tolerance_of_transformers_eager(mode):
    """docs/transformers.md's bfloat16 tolerance: every decode step's logits within 5 % of the largest logit
    (max |difference| / max |logit|) of transformers' eager forward over the same tokens. Printed
    beside: how far transformers' own eager generation is from that forward."""
    model = build_model(LLAMA_3_2_1B, torch.bfloat16, seed=random.randrange(2**31))
    model.set_attn_implementation(hf.ATTENTION)
    generator = hf.Generator(model, max_length=PROMPT + 64, max_batch_size=4, mode=mode, progress=False)
    ids = fresh_prompts(4, PROMPT)
    tokens, logits = generator.generate(ids, 64, return_logits=True)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        expected = model(tokens[:, :-1]).logits[:, PROMPT - 1 :]
        own = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, output_logits=True, return_dict_in_generate=True)
    same = int((own.sequences == tokens).all(dim=0)[PROMPT:].long().cumprod(0).sum())  # new tokens both paths share
    floor = relative_difference(torch.stack(own.logits, dim=1)[:, : max(same, 1)], expected[:, : max(same, 1)])
    relative = relative_difference(logits, expected)
    print(f"{mode}: bfloat16 logits, max |difference| / max |logit| = {relative:.4f}; transformers' own generation: {floor:.4f} over its first {same} tokens")
    assert relative <= 0.05
    del generator, model
    torch.cuda.empty_cache()


def test_the_first_generate_captures_before_it_fills_the_cache(fp32_model):
    """Capturing runs the decode step once, which writes cache slots: a Generator that captures on
    its first generate() must do so before that call's prefill."""
    fp32_model.set_attn_implementation(hf.ATTENTION)
    generator = hf.Generator(fp32_model, max_length=64, max_batch_size=2, progress=False)
    ids = fresh_prompts(2, 16)
    assert torch.equal(generator.generate(ids, 32), transformers_eager_generate(fp32_model, ids, 32))
    generator.runner.release()


def test_a_runner_its_user_released_captures_nothing_more_and_calls_decode_eagerly(fp32_model):
    fp32_model.set_attn_implementation(hf.ATTENTION)
    generator = hf.Generator(fp32_model, max_length=64, max_batch_size=4, progress=False)
    one, four = fresh_prompts(1, 16), fresh_prompts(4, 16)
    expected_one, expected_four = (transformers_eager_generate(fp32_model, ids, 16) for ids in (one, four))
    assert torch.equal(generator.generate(one, 16), expected_one)  # captures size 1
    generator.runner.release()
    assert torch.equal(generator.generate(four, 16), expected_four)  # size 4: eagerly, nothing captured
    assert torch.equal(generator.generate(one, 16), expected_one)
    assert generator.runner.released and generator.runner.graphs == {}
    generator.runner.restore()  # size 1, as before the release
    assert [size for _key, size in generator.runner.graphs] == [1]
    assert torch.equal(generator.generate(one, 16), expected_one)
    generator.runner.release()


def test_a_dropped_generator_gives_its_cache_and_graphs_back_at_once(fp32_model):
    fp32_model.set_attn_implementation(hf.ATTENTION)
    generator = hf.Generator(fp32_model, max_length=64, max_batch_size=2, progress=False)
    generator.generate(fresh_prompts(2, 16), 8)
    torch.cuda.synchronize()
    held, pool = torch.cuda.memory_allocated(), generator.runner.pool
    keys, pool = weakref.ref(generator.cache.layers[0].keys), weakref.ref(pool)
    gc.disable()
    try:
        del generator
        assert keys() is None and pool() is None, "a reference cycle keeps it for the collector"
        assert torch.cuda.memory_allocated() < held
    finally:
        gc.enable()
