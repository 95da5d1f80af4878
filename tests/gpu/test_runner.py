"""GraphRunner on a small transformer whose attention is an eager break."""

import dataclasses
import random

import pytest
import torch

import breakgraph as bg
from breakgraph.demo import TinyTransformer
from tests.helpers import assert_close
from tests.test_trees import Output

DEV = "cuda"
MAX = 24


def _runner(**kwargs):
    torch.manual_seed(0)
    model = TinyTransformer(dim=64, heads=4, layers=2).to(DEV).eval()
    static = torch.zeros(MAX, 8, 64, device=DEV)
    with torch.no_grad():
        runner = bg.GraphRunner(model, static, **kwargs)
        runner.capture()
    return model, runner


@torch.no_grad()
def test_random_batches_match_eager_and_padding_does_not_leak(capsys):
    model, runner = _runner(capture_sizes=[1, 2, 4, 8, 16, 24], pad_value=1e4)
    captured_err = capsys.readouterr().err
    assert "breakgraph: capturing" in captured_err  # tqdm's bar
    rng = random.Random(0)
    for _ in range(12):
        n = rng.randint(1, MAX)
        x = torch.randn(n, 8, 64, device=DEV)
        out = runner(x)
        assert out.shape[0] == n
        assert_close(out, model(x), 1e-4, 1e-4)
    report = runner.report()
    assert [row["size"] for row in report["rows"]] == [1, 2, 4, 8, 16, 24]
    assert all(row["eager_breaks"] == 2 for row in report["rows"])
    printed = capsys.readouterr().out
    assert "pool holds" in printed and "capture_ms" in printed


@torch.no_grad()
def test_above_the_largest_size_runs_eagerly():
    model, runner = _runner(capture_sizes=[1, 4])
    x = torch.randn(7, 8, 64, device=DEV)
    assert runner.select(7) is None
    assert_close(runner(x), model(x), 1e-4, 1e-4)
    with pytest.raises(ValueError, match="n = 0"):
        runner(torch.randn(0, 8, 64, device=DEV))
    with pytest.raises(ValueError, match="does not fit"):
        runner(torch.randn(2, 9, 64, device=DEV))
    with pytest.raises(ValueError, match="dtype"):
        runner(torch.randn(2, 8, 64, device=DEV, dtype=torch.float16))


@torch.no_grad()
def test_clone_returns_independent_outputs():
    model, runner = _runner(capture_sizes=[4], clone=True)
    a = runner(torch.randn(3, 8, 64, device=DEV))
    b_in = torch.randn(3, 8, 64, device=DEV)
    b = runner(b_in)
    assert a.data_ptr() != b.data_ptr()
    assert_close(b, model(b_in), 1e-4, 1e-4)


@torch.no_grad()
def test_shared_pool_is_smaller_than_separate_pools():
    sizes = [1, 2, 4, 8, 16, 24]
    _model, shared = _runner(capture_sizes=sizes, progress=False)
    shared_bytes = bg.pool_bytes(shared.pool)
    separate = 0
    for size in sizes:
        _m, single = _runner(capture_sizes=[size], progress=False)
        separate += bg.pool_bytes(single.pool)
    print(f"pool bytes: shared {shared_bytes}, separate pools summed {separate}")
    assert shared_bytes < separate


@torch.no_grad()
def test_keys_pick_graph_variants_in_priority_order():
    calls = []

    def fn(x, key):
        calls.append(key)
        return x * (2 if key == "uniform" else 3)

    static = torch.zeros(8, 4, device=DEV)
    runner = bg.GraphRunner(
        fn,
        static,
        capture_sizes={"uniform": [1, 2], "mixed": [1, 2, 4, 8]},
        keys=["uniform", "mixed"],
        key_fn=lambda x: ["uniform", "mixed"] if bool((x[:, 0] >= 0).all()) else ["mixed"],
        progress=False,
    ).capture()
    pos = torch.rand(2, 4, device=DEV)
    assert_close(runner(pos), pos * 2)  # uniform graph preferred
    pos4 = torch.rand(4, 4, device=DEV)
    assert_close(runner(pos4), pos4 * 3)  # no uniform graph of 4: falls to mixed
    neg = -torch.rand(2, 4, device=DEV)
    assert_close(runner(neg), neg * 3)


def test_capture_of_some_keys_leaves_the_others_for_a_later_call():
    static = torch.zeros(4, 4, device=DEV)
    runner = bg.GraphRunner(
        lambda x, key: x * (2 if key == "a" else 3), static, capture_sizes=[1, 4], keys=["a", "b"], key_fn=lambda x: ["b"], progress=False
    )
    runner.capture(keys=["b"])
    assert sorted(runner.graphs) == [("b", 1), ("b", 4)]
    x = torch.rand(3, 4, device=DEV)
    assert_close(runner(x), x * 3)
    runner.capture()  # the rest, into the same pool
    assert sorted(runner.graphs) == [("a", 1), ("a", 4), ("b", 1), ("b", 4)]
    assert {graph.pool for graph in runner.graphs.values()} == {runner.pool}


@torch.no_grad()
def test_debug_mode_runner_matches_eager():
    model, runner = _runner(capture_sizes=[2, 4], debug=True, progress=False)
    x = torch.randn(3, 8, 64, device=DEV)
    assert_close(runner(x), model(x), 1e-4, 1e-4)
    assert all(g.num_eager_breaks == 1 and g.num_graphs == 0 for g in runner.graphs.values())


@torch.no_grad()
def test_auto_warmup_runs_once_per_key_and_every_size_matches_eager():
    model, runner = _runner(capture_sizes=[1, 2, 4, 8, 16, 24], progress=False)
    report = runner.report(print_table=False)
    assert [row["size"] for row in report["rows"] if row["warmed_up"]] == [24]  # the first size captured
    for n in (1, 3, 7, 16, 24):
        x = torch.randn(n, 8, 64, device=DEV)
        assert_close(runner(x), model(x), 1e-4, 1e-4)


@torch.no_grad()
def test_auto_warmup_warms_up_a_size_whose_capture_needs_it():
    initialised = set()

    def fn(x):
        if x.shape[0] not in initialised:  # lazy per-size set-up, as autotuners do: a host sync
            initialised.add(x.shape[0])
            x.sum().item()
        return softmax_rows(x) * 2

    static = torch.zeros(8, 4, device=DEV)
    runner = bg.GraphRunner(fn, static, capture_sizes=[2, 8], progress=False).capture()
    assert {row["size"]: row["warmed_up"] for row in runner.report(print_table=False)["rows"]} == {2: True, 8: True}
    for n in (1, 2, 5):
        x = torch.randn(n, 4, device=DEV)
        assert_close(runner(x), torch.softmax(x, -1) * 2)


@bg.eager_on_graph
def softmax_rows(x):
    return torch.softmax(x, -1)


@torch.no_grad()
def test_lazy_runner_captures_each_size_on_first_use():
    model, runner = _runner(capture_sizes=[2, 4, 8], lazy=True, progress=False)
    assert runner.graphs == {}
    x = torch.randn(3, 8, 64, device=DEV)
    assert_close(runner(x), model(x), 1e-4, 1e-4)
    assert list(runner.graphs) == [(None, 4)]
    row = runner.report(print_table=False)["rows"][0]
    assert row["size"] == 4 and row["first_use_ms"] > 0 and row["warmed_up"]
    again = torch.randn(4, 8, 64, device=DEV)
    assert_close(runner(again), model(again), 1e-4, 1e-4)
    assert list(runner.graphs) == [(None, 4)]


@torch.no_grad()
def test_a_size_captured_on_first_use_is_replayed_once_for_that_call():
    calls = torch.zeros((), device=DEV)

    def count_and_scale(x):
        calls.add_(1)  # state a graph changes: a second replay would count twice
        return x * calls

    runner = bg.GraphRunner(count_and_scale, torch.zeros(8, 4, device=DEV), [4, 8], lazy=True, warmup=0, progress=False)
    for count, n in enumerate([3, 3, 6, 2, 8], start=1):  # size 4 captured, replayed; size 8 captured; ...
        x = torch.randn(n, 4, device=DEV)
        out = runner(x)
        assert calls.item() == count
        assert_close(out, x * count, 0, 0)
    assert sorted(runner.graphs) == [(None, 4), (None, 8)]


@dataclasses.dataclass
class Scores:
    logits: torch.Tensor
    rows: int


@torch.no_grad()
def test_outputs_inside_dataclasses_come_back_with_the_live_rows_and_cloned_when_asked():
    def scores(x):
        return Scores(torch.softmax(x, -1), rows=x.shape[0])

    with pytest.warns(bg.FrozenOutputWarning, match=r"returned 8 \(int\) at output.rows"):
        runner = bg.GraphRunner(scores, torch.zeros(8, 4, device=DEV), [8], clone=True, progress=False).capture()
    x = torch.randn(3, 4, device=DEV)
    first = runner(x)
    assert first.logits.shape == (3, 4) and first.rows == 8  # a number the graph froze at capture
    assert_close(first.logits, torch.softmax(x, -1), 1e-6, 1e-6)
    kept = first.logits.clone()
    runner(torch.randn(5, 4, device=DEV))
    assert torch.equal(first.logits, kept)  # a clone: the next call does not overwrite it


@torch.no_grad()
def test_an_output_that_is_a_dict_too_comes_back_with_its_items_cut_to_the_live_rows():
    runner = bg.GraphRunner(lambda x: Output(logits=x * 2), torch.zeros(8, 4, device=DEV), [8], progress=False).capture()
    x = torch.randn(3, 4, device=DEV)
    out = runner(x)  # as transformers' ModelOutput: its fields are its items
    assert type(out) is Output and out["logits"] is out.logits and out.logits.shape == (3, 4)
    assert_close(out["logits"], x * 2, 0, 0)


@torch.no_grad()
def test_capturing_some_sizes_leaves_the_others_to_first_use_and_restore_captures_what_was_captured():
    torch.manual_seed(0)
    model = TinyTransformer(dim=64, heads=4, layers=2).to(DEV).eval()
    runner = bg.GraphRunner(model, torch.zeros(8, 8, 64, device=DEV), [1, 2, 4, 8], progress=False).capture(sizes=[4])
    assert list(runner.graphs) == [(None, 4)]
    x = torch.randn(2, 8, 64, device=DEV)
    assert_close(runner(x), model(x), 1e-4, 1e-4)  # size 2, captured on this call
    assert sorted(runner.graphs) == [(None, 2), (None, 4)]
    runner.release()
    runner.restore()
    assert sorted(runner.graphs) == [(None, 2), (None, 4)]
    for n in (2, 3):
        x = torch.randn(n, 8, 64, device=DEV)
        assert_close(runner(x), model(x), 1e-4, 1e-4)


@torch.no_grad()
def test_modes_route_uniform_batches_to_full_graphs_and_mixed_ones_to_breakable_graphs():
    ran_eagerly = []

    @bg.eager_on_graph
    def scale_rows(x, lengths):
        ran_eagerly.append(x.shape[0])
        return x * lengths.max().item()  # a host read: only a break can do it

    @scale_rows.inline
    def scale_rows_on_device(x, lengths):
        return x * lengths.max()

    def fn(x, lengths, key):
        return scale_rows(torch.tanh(x), lengths) + 1

    static = (torch.zeros(8, 4, device=DEV), torch.zeros(8, device=DEV))
    replays = []
    runner = bg.GraphRunner(
        fn,
        static,
        capture_sizes=[2, 4, 8],
        keys=["uniform", "mixed"],
        key_fn=lambda x, lengths: ["uniform", "mixed"] if bool((lengths == lengths[0]).all()) else ["mixed"],
        modes={"uniform": "full", "mixed": "breakable"},
        after_replay=lambda: replays.append(1),
        progress=False,
    ).capture()
    graphs = runner.graphs
    assert all(graphs[("uniform", s)].num_eager_breaks == 0 and graphs[("uniform", s)].num_graphs == 1 for s in (2, 4, 8))
    assert all(graphs[("mixed", s)].num_eager_breaks == 1 for s in (2, 4, 8))
    assert {row["key"]: row["mode"] for row in runner.report(print_table=False)["rows"]} == {"mixed": "breakable", "uniform": "full"}
    ran_eagerly.clear()
    for n, lengths, breaks_ran in [(3, [5.0] * 3, False), (3, [5.0, 2.0, 7.0], True), (8, [1.0] * 8, False), (6, [3.0, 1.0] * 3, True)]:
        x, lengths = torch.randn(n, 4, device=DEV), torch.tensor(lengths, device=DEV)
        before = len(ran_eagerly)
        assert_close(runner(x, lengths), torch.tanh(x) * lengths.max() + 1)
        assert (len(ran_eagerly) > before) == breaks_ran  # mixed batches take the breakable graphs
    assert len(replays) == 4




@torch.no_grad()
def test_a_size_whose_capture_fails_is_served_eagerly_and_reported():
    def fn(x):
        if x.shape[0] == 4:
            x.sum().item()  # a host sync every time at this size: no warm-up helps
        return softmax_rows(x) * 2

    static = torch.zeros(8, 4, device=DEV)
    with pytest.raises(bg.UncapturableOpError):
        bg.GraphRunner(fn, static, capture_sizes=[2, 4, 8], progress=False).capture()
    runner = bg.GraphRunner(fn, static, capture_sizes=[2, 4, 8], progress=False, on_capture_error="eager").capture()
    assert set(runner.graphs) == {(None, 2), (None, 8)}
    report = runner.report(print_table=False)
    assert [row["size"] for row in report["failed"]] == [4] and "UncapturableOpError" in report["failed"][0]["reason"]
    for n in (1, 3, 4, 7):
        x = torch.randn(n, 4, device=DEV)
        assert_close(runner(x), torch.softmax(x, -1) * 2)


@torch.no_grad()
def test_garbage_in_the_padded_rows_never_reaches_the_live_rows():
    """Padding is the model's job in one sense: its rows must not mix. For such a model
    (row-wise ops and breaks), NaN padding leaves rows 0:n exact."""
    model, runner = _runner(capture_sizes=[8, 16, 24], pad_value=float("nan"))
    for n in (1, 5, 13, 20):
        x = torch.randn(n, 8, 64, device=DEV)
        out = runner(x)
        assert torch.isfinite(out).all()
        assert_close(out, model(x), 1e-4, 1e-4)
