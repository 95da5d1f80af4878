"""Sampling in breakgraph.hf on the CPU: the settings' checks, the filters against transformers' warpers,
the draw's distribution against the filtered softmax and against transformers' own sampling, and the
Generator's eager path with seeded generators."""

import itertools
import math

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from transformers import GenerationConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from breakgraph import hf
from breakgraph.hf.sampling import warp
from tests.helpers import tiny_llama, transformers_eager_generate

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # without a GPU the runners warn that they run eagerly

DRAWS = 24_000
P_VALUE = 1e-3
# 16 tokens' logits, no two alike, so that no setting below cuts the vocabulary near a tie or a boundary
LOGITS = torch.tensor([2.1, -0.4, 0.9, 1.6, -1.3, 0.2, 2.6, -2.2, 1.1, 0.5, -0.8, 1.9, -3.0, 0.0, 1.35, -1.7])
SETTINGS = {
    "temperature 0.6": (0.6, 0, 1.0),
    "temperature 1.8": (1.8, 0, 1.0),
    "top_k 5": (1.0, 5, 1.0),
    "top_p 0.8": (1.0, 0, 0.8),
    "all three, temperature 0.7": (0.7, 10, 0.9),
    "all three, temperature 1.5": (1.5, 8, 0.75),
}


# -- the checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"temperature": 0.0}, r"temperature must be a finite number > 0, got 0.0: for greedy decoding pass do_sample=False"),
        ({"temperature": -0.5}, r"temperature must be a finite number > 0, got -0.5"),
        ({"temperature": math.inf}, r"temperature must be a finite number > 0, got inf"),
        ({"temperature": math.nan}, r"temperature must be a finite number > 0, got nan"),
        ({"temperature": "0.7"}, r"temperature must be a finite number > 0, got '0.7'"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0: 1.0 keeps every token \(no top-p filter\)"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": math.nan}, r"top_p must be in \(0, 1\], got nan"),
        ({"top_k": -1}, r"top_k must be a whole number >= 0, got -1: 0 keeps every token \(no top-k filter\)"),
        ({"top_k": 2.5}, r"top_k must be a whole number >= 0, got 2.5"),
        ({"top_k": True}, r"top_k must be a whole number >= 0, got True"),
    ],
)
def test_bad_settings_are_refused_saying_what_to_do(settings, message):
    with pytest.raises(ValueError, match=message):
        hf.Sampling(do_sample=True, **settings)
    hf.Sampling(do_sample=False, **settings)  # greedy ignores them, as transformers does


def test_do_sample_must_be_a_bool():
    with pytest.raises(TypeError, match=r"do_sample must be True or False, got 'yes' \(str\)"):
        hf.Sampling(do_sample="yes")


def test_settings_come_from_the_call_then_the_generation_config_then_transformers_defaults():
    assert hf.Sampling.resolve(GenerationConfig()) == hf.Sampling(False, 1.0, 50, 1.0)
    config = GenerationConfig(do_sample=True, temperature=0.6, top_k=20)
    assert hf.Sampling.resolve(config) == hf.Sampling(True, 0.6, 20, 1.0)
    assert hf.Sampling.resolve(config, temperature=1.3, top_k=0, top_p=0.5) == hf.Sampling(True, 1.3, 0, 0.5)
    assert hf.Sampling.resolve(config, do_sample=False).do_sample is False
    rows = hf.Sampling(True, 0.6, 20, 0.9).rows(3, "cpu")
    assert {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in rows.items()} == {
        "temperature": (torch.float32, (3,)), "top_k": (torch.int64, (3,)), "top_p": (torch.float64, (3,)),
    }


# -- the filters against transformers' warpers -----------------------------------------------


def transformers_warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The scores transformers' sampling leaves: its warpers in its order, each where it applies one."""
    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


def warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    return warp(logits, **hf.Sampling(True, temperature, top_k, top_p).rows(logits.shape[0], logits.device))


GRID = list(itertools.product([0.5, 1.0, 1.7], [0, 1, 3, 10, 40, 100], [0.05, 0.3, 0.9, 1.0]))


def test_the_kept_tokens_and_their_scores_are_transformers_on_random_logits():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 40, generator=generator) * 3
    for temperature, top_k, top_p in GRID:
        ours, theirs = warped(logits, temperature, top_k, top_p), transformers_warped(logits, temperature, top_k, top_p)
        kept = torch.isfinite(ours)
        assert torch.equal(kept, torch.isfinite(theirs)), (temperature, top_k, top_p)
        assert torch.equal(ours[kept], theirs[kept])
        assert bool(kept.any(dim=1).all())


def test_ties_are_kept_at_the_top_k_score_and_cut_at_the_top_p_one_as_transformers_counts():
    """Logits of 9 values over 40 tokens tie everywhere. Top-k keeps every token tied with the k-th
    score, exactly as transformers. Where top-p cuts inside a tie, which of the tied tokens are kept
    is each sort's order among equals (ours stable: the higher ids), so there the rows keep as many
    tokens as transformers' and differ only among tokens tied with the cut."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randint(-4, 5, (300, 40), generator=generator).float()
    cut_inside_a_tie = 0
    for temperature, top_k, top_p in GRID:
        ours, theirs = warped(logits, temperature, top_k, top_p), transformers_warped(logits, temperature, top_k, top_p)
        kept, kept_by_them = torch.isfinite(ours), torch.isfinite(theirs)
        if top_p == 1.0:
            assert torch.equal(kept, kept_by_them), (temperature, top_k)
            if 0 < top_k < 40:
                assert bool((kept.sum(dim=1) >= min(top_k, 40)).all())
                assert bool((kept.sum(dim=1) > top_k).any())  # ties at the k-th score were kept
            continue
        assert torch.equal(kept.sum(dim=1), kept_by_them.sum(dim=1)), (temperature, top_k, top_p)
        cut = torch.where(kept, ours, math.inf).amin(dim=1, keepdim=True)  # the lowest score kept
        differ = kept != kept_by_them
        assert bool(((logits / temperature) == cut)[differ].all()), (temperature, top_k, top_p)
        cut_inside_a_tie += int(differ.any())
    assert cut_inside_a_tie > 0  # the logits do put ties at the cut


def test_top_p_removes_a_cumulative_probability_equal_to_one_minus_top_p_as_transformers():
    """Four equal logits: cumulative probabilities 0.25, 0.5, 0.75 and 1, exactly. Among the tied
    tokens the higher ids are kept (a stable sort)."""
    logits = torch.zeros(1, 4)
    for top_p, kept in ((0.25, [3]), (0.5, [2, 3]), (0.75, [1, 2, 3]), (0.8, [0, 1, 2, 3])):
        ours = torch.isfinite(warped(logits, 1.0, 0, top_p))[0]
        assert ours.nonzero().flatten().tolist() == kept
        assert int(torch.isfinite(transformers_warped(logits, 1.0, 0, top_p)).sum()) == len(kept)


# -- the draw's distribution -----------------------------------------------------------------


def expected_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What a token is drawn with, worked out afresh in float64: temper, keep the tokens scoring at
    least the k-th highest score, then the most likely ones while the mass above each is < top_p."""
    scores = logits.double() / temperature
    keep = torch.ones_like(scores, dtype=torch.bool)
    if top_k:
        keep &= scores >= scores.sort(descending=True).values[top_k - 1]
    probs = scores.masked_fill(~keep, -math.inf).softmax(0)
    if top_p < 1:
        order = probs.argsort(descending=True)
        above = probs[order].cumsum(0) - probs[order]
        assert float((above - top_p).abs().min()) > 1e-3, "a setting cuts near a boundary: pick other logits"
        keep[order[above >= top_p]] = False
    return scores.masked_fill(~keep, -math.inf).softmax(0)


def p_value(chi2: float, df: int) -> float:
    """The chi-square distribution's upper tail: the regularized upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)))


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``counts`` drawn from ``probs``; a count where ``probs`` is 0 fails outright."""
    possible = probs > 0
    assert int(counts[~possible].sum()) == 0, f"drawn where the filters removed: {counts.tolist()}"
    expected = counts.sum() * probs[possible]
    chi2 = float(((counts[possible] - expected) ** 2 / expected).sum())
    return p_value(chi2, int(possible.sum()) - 1)


def same_distribution(counts: torch.Tensor, other: torch.Tensor) -> float:
    """p-value of two equally many draws coming from one distribution (two-sample chi-square)."""
    assert int(counts.sum()) == int(other.sum())
    seen = (counts + other) > 0
    a, b = counts[seen].double(), other[seen].double()
    return p_value(float(((a - b) ** 2 / (a + b)).sum()), int(seen.sum()) - 1)


def transformers_draws(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator) -> torch.Tensor:
    """Tokens as transformers' generate(do_sample=True) draws them: its warpers, softmax, multinomial."""
    probs = transformers_warped(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@pytest.mark.parametrize("temperature, top_k, top_p", list(SETTINGS.values()), ids=list(SETTINGS))
def test_draws_follow_the_filtered_softmax_and_transformers_sampling(temperature, top_k, top_p):
    batch = LOGITS.expand(DRAWS, -1)
    rows = hf.Sampling(True, temperature, top_k, top_p).rows(DRAWS, "cpu")
    ours = torch.bincount(hf.sample(batch, **rows, generator=torch.Generator().manual_seed(2)), minlength=16)
    theirs = torch.bincount(transformers_draws(batch, temperature, top_k, top_p, torch.Generator().manual_seed(3)), minlength=16)
    probs = expected_probabilities(LOGITS, temperature, top_k, top_p)
    assert goodness_of_fit(ours, probs) > P_VALUE
    assert goodness_of_fit(theirs, probs) > P_VALUE  # the reference agrees with transformers
    assert same_distribution(ours, theirs) > P_VALUE
    assert torch.equal(torch.isfinite(warped(LOGITS[None], temperature, top_k, top_p))[0], probs > 0)


NARROW = {name: setting for name, setting in SETTINGS.items() if 1 <= setting[1] <= 10}  # top-k keeps at most 10


@pytest.mark.parametrize("temperature, top_k, top_p", list(NARROW.values()), ids=list(NARROW))
def test_a_draw_among_candidates_follows_the_same_distribution(temperature, top_k, top_p):
    batch = LOGITS.expand(DRAWS, -1)
    rows = hf.Sampling(True, temperature, top_k, top_p).rows(DRAWS, "cpu")
    ours = torch.bincount(hf.sample(batch, **rows, generator=torch.Generator().manual_seed(4), candidates=10), minlength=16)
    theirs = torch.bincount(transformers_draws(batch, temperature, top_k, top_p, torch.Generator().manual_seed(5)), minlength=16)
    assert goodness_of_fit(ours, expected_probabilities(LOGITS, temperature, top_k, top_p)) > P_VALUE
    assert same_distribution(ours, theirs) > P_VALUE


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (50, 1.0), (50, 0.9), (hf.CANDIDATES, 0.95), (hf.CANDIDATES, 1.0)])
def test_the_candidates_hold_what_transformers_keeps_where_top_k_keeps_no_more_than_they_are(top_k, top_p):
    """Logits without ties: transformers' top-k keeps every token tied at the k-th score, which
    may be one more than the candidates. Each row is normal quantiles in a fresh random order."""
    ranks = torch.stack([torch.randperm(1000) for _ in range(64)])
    logits = torch.special.ndtri((ranks.double() + 0.5) / 1000).float() * 3
    rows = hf.Sampling(True, 0.8, top_k, top_p).rows(64, "cpu")
    scores, tokens = logits.topk(hf.CANDIDATES, dim=-1)
    kept = torch.full_like(logits, -math.inf).scatter(-1, tokens, warp(scores, **rows))
    theirs = transformers_warped(logits, 0.8, top_k, top_p)
    assert torch.equal(torch.isfinite(kept), torch.isfinite(theirs))
    torch.testing.assert_close(kept.softmax(-1), theirs.softmax(-1))
    assert hf.Sampling(True, top_k=top_k).among_candidates and not hf.Sampling(True, top_k=0).among_candidates


def test_the_fit_tells_a_wrong_distribution_apart():
    """The test above can fail: the same draws against slightly wrong settings."""
    rows = hf.Sampling(True, 0.7, 10, 0.9).rows(DRAWS, "cpu")
    ours = torch.bincount(hf.sample(LOGITS.expand(DRAWS, -1), **rows, generator=torch.Generator().manual_seed(2)), minlength=16)
    assert goodness_of_fit(ours, expected_probabilities(LOGITS, 0.7, 10, 0.9)) > P_VALUE
    assert goodness_of_fit(ours, expected_probabilities(LOGITS, 0.75, 10, 0.9)) < P_VALUE  # another temperature
    assert goodness_of_fit(ours, expected_probabilities(LOGITS, 0.7, 10, 1.0)) < P_VALUE  # no top-p: tokens never drawn
    with pytest.raises(AssertionError, match="drawn where the filters removed"):
        goodness_of_fit(ours, expected_probabilities(LOGITS, 0.7, 10, 0.8))  # a tighter top-p


def test_rows_draw_with_their_own_settings():
    rows = {
        "temperature": torch.tensor([1.0, 0.5, 2.0]),
        "top_k": torch.tensor([1, 0, 3]),
        "top_p": torch.tensor([1.0, 0.3, 1.0], dtype=torch.float64),
    }
    kept = torch.isfinite(warp(LOGITS.expand(3, -1), **rows))
    assert kept[0].nonzero().flatten().tolist() == [6]  # top_k 1: the highest logit
    assert kept[1].nonzero().flatten().tolist() == [6]  # top_p 0.3 at temperature 0.5: its mass is above 0.3
    assert kept[2].nonzero().flatten().tolist() == [0, 6, 11]
    tokens = torch.stack([hf.sample(LOGITS.expand(3, -1), **rows) for _ in range(200)])
    assert set(tokens[:, 0].tolist()) == {6} and set(tokens[:, 2].tolist()) == {0, 6, 11}


# -- the Generator, eagerly ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    model = tiny_llama()
    model.set_attn_implementation(hf.ATTENTION)
    return model


@pytest.fixture(scope="module")
def generator(model):
    return hf.Generator(model, max_length=48, max_batch_size=4, progress=False)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_seeded_generator_gives_the_same_tokens_and_another_seed_others(generator):
    ids = torch.randint(0, 300, (3, 8))
    first = generator.generate(ids, 12, do_sample=True, generator=seeded(5))
    assert torch.equal(generator.generate(ids, 12, do_sample=True, generator=seeded(5)), first)
    assert not torch.equal(generator.generate(ids, 12, do_sample=True, generator=seeded(6)), first)
    assert torch.equal(first[:, :8], ids)


@pytest.mark.parametrize("top_k, raced", [(0, 300), (50, min(hf.CANDIDATES, 300))])  # over the vocabulary, or the candidates
def test_the_user_s_generator_advances_as_if_it_had_drawn_every_token(generator, top_k, raced):
    ids = torch.randint(0, 300, (2, 5))
    mine = seeded(9)
    first = generator.generate(ids, 6, do_sample=True, temperature=0.8, top_k=top_k, generator=mine)
    reference = seeded(9)
    for _ in range(6):  # one exponential race over (rows, what it races) per token
        torch.empty(2, raced).exponential_(generator=reference)
    assert torch.equal(mine.get_state(), reference.get_state())
    second = generator.generate(ids, 6, do_sample=True, temperature=0.8, top_k=top_k, generator=mine)
    assert not torch.equal(second, first)  # it goes on from where the first call left it


def test_without_a_generator_the_default_one_draws_and_manual_seed_repeats(generator):
    ids = torch.randint(0, 300, (2, 5))
    torch.manual_seed(11)
    first = generator.generate(ids, 10, do_sample=True, top_p=0.9)
    after = torch.get_rng_state()
    torch.manual_seed(11)
    assert torch.equal(generator.generate(ids, 10, do_sample=True, top_p=0.9), first)
    assert not torch.equal(torch.get_rng_state(), seeded(11).get_state()) and torch.equal(torch.get_rng_state(), after)


def test_greedy_is_unchanged_and_top_k_1_samples_the_greedy_tokens(model, generator):
    ids = torch.randint(0, 300, (3, 7))
    expected = transformers_eager_generate(model, ids, 12)
    assert torch.equal(generator.generate(ids, 12), expected)
    assert torch.equal(generator.generate(ids, 12, do_sample=False, temperature=0.0), expected)  # greedy ignores it
    assert torch.equal(generator.generate(ids, 12, do_sample=True, top_k=1, generator=seeded(0)), expected)


def test_the_generation_config_s_do_sample_samples(model, generator):
    ids = torch.randint(0, 300, (2, 6))
    explicit = generator.generate(ids, 8, do_sample=True, temperature=0.7, generator=seeded(4))
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.7
    try:
        assert torch.equal(generator.generate(ids, 8, generator=seeded(4)), explicit)
    finally:
        model.generation_config.do_sample, model.generation_config.temperature = None, None


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"do_sample": True, "temperature": 0}, ValueError, r"for greedy decoding pass do_sample=False"),
        ({"do_sample": True, "top_p": 2.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"do_sample": True, "top_k": -5}, ValueError, r"top_k must be a whole number >= 0"),
        ({"do_sample": True, "generator": 42}, TypeError, r"generator must be a torch.Generator, got int"),
        ({"do_sample": True, "tempreature": 0.5}, TypeError, r"unknown option 'tempreature'; did you mean 'temperature'\?"),
    ],
)
def test_generate_refuses_bad_settings_before_it_runs_anything(generator, options, error, message):
    calls = []
    hook = generator.model.register_forward_pre_hook(lambda *args: calls.append(1))
    mine = seeded(3)
    try:
        with pytest.raises(error, match=message):
            generator.generate(torch.randint(0, 300, (2, 5)), 4, **({"generator": mine} | options))
    finally:
        hook.remove()
    assert not calls and torch.equal(mine.get_state(), seeded(3).get_state())


def test_a_generator_on_another_device_than_the_model_is_refused(monkeypatch, generator):
    monkeypatch.setattr(generator, "device", torch.device("cuda", 0))  # a CUDA model, as the check sees it
    with pytest.raises(ValueError, match=r"generator is on cpu, but the model is on cuda:0.*torch.Generator\('cuda:0'\)"):
        generator.generate(torch.randint(0, 300, (1, 4)), 2, do_sample=True, generator=seeded(0))
