"""Sampling on the GPU: hf.sample captured in a breakgraph graph (fresh tokens at every replay, the
filtered softmax's distribution, transformers' sampling's), and the Generator's sampling graphs in
both modes (captured on first use, drawing inside the graph, seeded runs repeatable)."""

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from transformers import LlamaConfig, LlamaForCausalLM

import breakgraph as bg
from breakgraph import hf
from breakgraph.hf.generation import AMONG_CANDIDATES, OVER_VOCABULARY
from tests.test_hf_sampling import (
    LOGITS,
    NARROW,
    P_VALUE,
    SETTINGS,
    expected_probabilities,
    goodness_of_fit,
    same_distribution,
    transformers_draws,
)

DEV = "cuda"
ROWS, REPLAYS = 4096, 6  # 24,576 draws per setting
MODES = ["breakable", "full"]


@pytest.mark.parametrize("breaks", ["eager", "inline"])
@pytest.mark.parametrize("temperature, top_k, top_p", list(SETTINGS.values()), ids=list(SETTINGS))
def test_a_captured_draw_follows_the_filtered_softmax_and_transformers_sampling(breaks, temperature, top_k, top_p):
    logits = LOGITS.to(DEV).expand(ROWS, -1).contiguous()
    rows = hf.Sampling(True, temperature, top_k, top_p).rows(ROWS, DEV)
    torch.cuda.manual_seed(2)
    step = bg.graphed(hf.sample, logits, rows["temperature"], rows["top_k"], rows["top_p"], breaks=breaks)
    assert step.graph.draws_random_numbers
    draws = []
    for _ in range(REPLAYS):
        step.output.fill_(-1)  # poisoned: a replay that wrote nothing shows
        draws.append(step.replay().clone())
    tokens = torch.cat(draws)
    assert int(tokens.min()) >= 0
    assert not torch.equal(draws[0], draws[1])  # fresh numbers at every replay
    ours = torch.bincount(tokens, minlength=16).cpu()
    batch = LOGITS.to(DEV).expand(ROWS * REPLAYS, -1)
    generator = torch.Generator(DEV).manual_seed(3)
    theirs = torch.bincount(transformers_draws(batch, temperature, top_k, top_p, generator), minlength=16).cpu()
    probs = expected_probabilities(LOGITS, temperature, top_k, top_p)
    assert goodness_of_fit(ours, probs) > P_VALUE
    assert same_distribution(ours, theirs) > P_VALUE


@pytest.mark.parametrize("temperature, top_k, top_p", list(NARROW.values()), ids=list(NARROW))
def test_a_captured_draw_among_candidates_follows_the_same_distribution(temperature, top_k, top_p):
    logits = LOGITS.to(DEV).expand(ROWS, -1).contiguous()
    rows = hf.Sampling(True, temperature, top_k, top_p).rows(ROWS, DEV)
    step = bg.graphed(hf.sample, logits, rows["temperature"], rows["top_k"], rows["top_p"], candidates=10)
    draws = []
    for _ in range(REPLAYS):
        step.output.fill_(-1)
        draws.append(step.replay().clone())
    assert not torch.equal(draws[0], draws[1])
    ours = torch.bincount(torch.cat(draws), minlength=16).cpu()
    assert goodness_of_fit(ours, expected_probabilities(LOGITS, temperature, top_k, top_p)) > P_VALUE


def test_a_captured_draw_reads_each_row_s_settings_at_replay():
    logits = LOGITS.to(DEV).expand(4, -1).contiguous()
    rows = hf.Sampling(True, 1.0, 0, 1.0).rows(4, DEV)
    step = bg.graphed(hf.sample, logits, rows["temperature"], rows["top_k"], rows["top_p"])
    rows["top_k"].copy_(torch.tensor([1, 3, 0, 0]))
    rows["top_p"].copy_(torch.tensor([1.0, 1.0, 1e-6, 1.0]))
    rows["temperature"].copy_(torch.tensor([1.0, 1.0, 1.0, 1e-4]))
    seen = torch.stack([step.replay().clone() for _ in range(100)]).cpu()
    assert set(seen[:, 0].tolist()) == {6}  # top_k 1: the highest logit
    assert set(seen[:, 1].tolist()) == {0, 6, 11}  # top_k 3
    assert set(seen[:, 2].tolist()) == {6}  # top_p near 0 keeps the most likely
    assert set(seen[:, 3].tolist()) == {6}  # temperature near 0: greedy


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    with torch.device(DEV):
        model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    model.set_attn_implementation(hf.ATTENTION)
    return model


@pytest.fixture(scope="module", params=MODES)
def generator(request, model):
    generator = hf.Generator(model, max_length=64, max_batch_size=4, mode=request.param, progress=False)
    yield generator
    generator.runner.release()
    generator.sampling_runner.release()


def prompts(batch: int, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 300, (batch, length), device=DEV)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(DEV).manual_seed(seed)


@pytest.mark.parametrize("mode", MODES)
def test_each_call_captures_its_step_at_the_size_it_needs_and_the_sampling_graphs_draw_in_the_graph(model, mode):
    generator = hf.Generator(model, max_length=48, max_batch_size=4, mode=mode, progress=False)
    generator.generate(prompts(3), 8)
    assert sorted(generator.runner.graphs) == [(None, 4)]  # the size 3 rows need, and no other
    generator.generate(prompts(1), 8)
    assert sorted(generator.runner.graphs) == [(None, 1), (None, 4)]
    assert not generator.sampling_runner.graphs  # greedy captured no sampling graph
    assert not any(graph.draws_random_numbers for graph in generator.runner.graphs.values())
    with pytest.raises(ValueError, match="top_p must be in"):
        generator.generate(prompts(3), 8, do_sample=True, top_p=0.0)
    assert not generator.sampling_runner.graphs  # refused before anything was captured
    generator.generate(prompts(3), 8, do_sample=True)  # transformers' default top_k, 50: among the candidates
    assert sorted(generator.sampling_runner.graphs) == [(AMONG_CANDIDATES, 4)]
    generator.generate(prompts(2), 8, do_sample=True, top_k=0, top_p=0.9)  # the other variant, on its first use
    assert sorted(generator.sampling_runner.graphs) == [(AMONG_CANDIDATES, 4), (OVER_VOCABULARY, 2)]
    assert all(graph.draws_random_numbers for graph in generator.sampling_runner.graphs.values())
    generator.runner.release()
    generator.sampling_runner.release()

    up_front = hf.Generator(model, max_length=48, max_batch_size=4, mode=mode, progress=False).capture(sampling=True)
    assert len(up_front.sampling_runner.graphs) == 6 and not up_front.runner.graphs
    up_front.sampling_runner.release()


@pytest.mark.parametrize("top_k", [40, 0])  # among the candidates, over the vocabulary
def test_a_seeded_generator_gives_the_same_tokens_run_to_run_and_advances(generator, top_k):
    ids = prompts(3)
    mine = seeded(5)
    first = generator.generate(ids, 24, do_sample=True, temperature=0.9, top_k=top_k, top_p=0.95, generator=mine)
    assert not torch.equal(mine.get_state(), seeded(5).get_state())  # it advanced, as if it had drawn
    again = generator.generate(ids, 24, do_sample=True, temperature=0.9, top_k=top_k, top_p=0.95, generator=seeded(5))
    assert torch.equal(again, first)
    later = generator.generate(ids, 24, do_sample=True, temperature=0.9, top_k=top_k, top_p=0.95, generator=mine)
    assert not torch.equal(later, first)  # it goes on from where the first call left it


def test_unseeded_calls_draw_different_tokens_and_manual_seed_repeats_them(generator):
    ids = prompts(4)
    first = generator.generate(ids, 24, do_sample=True)
    assert not torch.equal(generator.generate(ids, 24, do_sample=True), first)
    torch.cuda.manual_seed(7)
    seeded_once = generator.generate(ids, 24, do_sample=True, top_p=0.9)
    torch.cuda.manual_seed(7)
    assert torch.equal(generator.generate(ids, 24, do_sample=True, top_p=0.9), seeded_once)


@pytest.mark.parametrize("batch", [1, 3])
def test_top_k_1_samples_the_greedy_tokens(generator, batch):
    ids = prompts(batch)
    greedy = generator.generate(ids, 24)
    assert torch.equal(generator.generate(ids, 24, do_sample=True, top_k=1, generator=seeded(1)), greedy)
    assert torch.equal(generator.generate(ids, 24, do_sample=True, top_k=1, temperature=3.0), greedy)


def test_a_batch_above_the_largest_captured_size_samples_eagerly_from_the_same_generator(model):
    generator = hf.Generator(model, max_length=48, max_batch_size=4, capture_sizes=[1, 2], progress=False)
    ids = prompts(3)
    first = generator.generate(ids, 12, do_sample=True, generator=seeded(8))
    assert torch.equal(generator.generate(ids, 12, do_sample=True, generator=seeded(8)), first)
    assert torch.equal(generator.generate(ids, 12, do_sample=True, top_k=1), generator.generate(ids, 12))
    generator.runner.release()
    generator.sampling_runner.release()
