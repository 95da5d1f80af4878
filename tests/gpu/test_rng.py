"""Random ops captured inside graph segments: fresh numbers at every replay, the right
distribution, and the generator's offsets exactly as under torch.cuda.graph."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import breakgraph as bg
import time

from breakgraph import recorder, rng
from breakgraph.runtime import cuda_available
from tests.helpers import assert_close, poison_

pytestmark = [
    pytest.mark.skipif(
        cuda_available() and not rng.cooperative(), reason="this torch's CUDA generators cannot be armed for raw captures"
    ),
]
DEV = "cuda"
N = 4096


@bg.eager_on_graph
def softmax_eager(x):
    return torch.softmax(x, -1)


def noisy_region(x):
    """Random ops in two segments around a break: randn, dropout, rand_like, bernoulli_, multinomial."""
    noise = torch.randn(N, device=DEV) * 2 + 1
    dropped = F.dropout(x, p=0.25, training=True)
    mixed = softmax_eager(dropped[:64].view(8, 8))
    uniform = torch.rand_like(x)
    coins = torch.empty(N, device=DEV).bernoulli_(0.5)
    picks = torch.multinomial(mixed, 4, replacement=True)
    return noise, dropped, uniform, coins, picks


def capture(fn, *args, **kwargs):
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph, **kwargs):
        out = fn(*args)
    return graph, out


def test_random_ops_are_captured_with_no_extra_breaks_and_draw_fresh_numbers():
    x = torch.ones(N, device=DEV)
    graph, out = capture(noisy_region, x)
    assert graph.num_eager_breaks == 1 and graph.num_graphs == 2  # only the softmax break
    assert graph.draws_random_numbers
    draws = []
    for _ in range(3):
        poison_(out)
        graph.replay()
        draws.append([t.clone() for t in out])
    for first, second in zip(draws, draws[1:]):
        for a, b in zip(first, second):
            assert not torch.equal(a, b)


def test_distribution_over_1000_replays():
    """randn N(1, 2²) and dropout p=0.25 over 1000 replays of 4096 draws each: about 4.1M
    samples, so the mean, variance and keep rate are known to about 0.001, 0.003 and
    0.0002 (one standard error); the tolerances are ten of those."""
    x = torch.ones(N, device=DEV)
    graph, (noise, dropped, *_rest) = capture(noisy_region, x)
    total, total_sq, kept = (torch.zeros((), device=DEV, dtype=torch.float64) for _ in range(3))
    firsts = []
    replays = 1000
    for _ in range(replays):
        graph.replay()
        total += noise.double().sum()
        total_sq += (noise.double() ** 2).sum()
        kept += (dropped != 0).double().sum()
        firsts.append(noise[:4].clone())
    count = replays * N
    mean = (total / count).item()
    variance = (total_sq / count).item() - mean**2
    keep_rate = (kept / count).item()
    assert abs(mean - 1.0) < 0.01, mean
    assert abs(variance - 4.0) < 0.03, variance
    assert abs(keep_rate - 0.75) < 0.002, keep_rate
    assert len({tuple(t.tolist()) for t in firsts}) == replays  # no replay repeated another's numbers
    kept_values = dropped[dropped != 0]
    assert torch.allclose(kept_values, torch.full_like(kept_values, 1 / 0.75))


def test_manual_seed_between_replays_behaves_as_under_torch_cuda_graph():
    x = torch.ones(N, device=DEV)
    ours, ours_out = capture(noisy_region, x)
    theirs = torch.cuda.CUDAGraph()
    with torch.cuda.graph(theirs, stream=torch.cuda.Stream()):
        theirs_out = noisy_region(x)  # outside a breakable capture the break runs inline
    for seed in (0, 1, 12345):
        torch.cuda.manual_seed(seed)
        ours.replay()
        after_ours = torch.randn(16, device=DEV)
        torch.cuda.manual_seed(seed)
        theirs.replay()
        after_theirs = torch.randn(16, device=DEV)
        for a, b in zip(ours_out, theirs_out):
            assert torch.equal(a, b)
        assert torch.equal(after_ours, after_theirs)  # eager draws continue from the same offset


def test_captured_training_step_uses_the_same_generator_offsets_as_eager():
    """Seeded, the masks are compared bit for bit (the same philox offsets draw the same
    bits); losses and weights within 1e-5, since the captured GEMMs and the eager ones
    need not sum in the same order."""
    def make():
        torch.manual_seed(0)
        layers = [nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 8)]
        return nn.Sequential(*layers).to(DEV)

    model, reference = make(), make()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    x, y = torch.randn(16, 32, device=DEV), torch.randn(16, 8, device=DEV)
    hidden = {}
    model[2].register_forward_hook(lambda _module, _inputs, out: hidden.__setitem__("dropped", out))

    def step():
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up: gradients exist before the capture, as with torch.cuda.graph
    torch.cuda.current_stream().wait_stream(side)
    graph, loss = capture(step)
    dropped = hidden["dropped"]  # the captured buffer that every replay refreshes
    assert graph.num_eager_breaks == 0 and graph.draws_random_numbers
    reference.load_state_dict(model.state_dict())  # capture changed no weight
    for seed in (3, 4, 5):
        fresh_x, fresh_y = torch.randn_like(x), torch.randn_like(y)
        x.copy_(fresh_x), y.copy_(fresh_y)
        torch.cuda.manual_seed(seed)
        graph.replay()
        torch.cuda.manual_seed(seed)
        ref_opt.zero_grad(set_to_none=False)
        ref_dropped = reference[:3](fresh_x)
        ref_loss = F.mse_loss(reference[3:](ref_dropped), fresh_y)
        ref_loss.backward()
        ref_opt.step()
        torch.cuda.synchronize()
        assert torch.equal(dropped == 0, ref_dropped == 0)
        assert_close(loss, ref_loss, 1e-5, 1e-5)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert_close(p, q, 1e-5, 1e-5)


def test_user_generator_passed_in_generators():
    gen = torch.Generator(device=DEV)
    x = torch.full((N,), 0.75, device=DEV)

    def region():
        return torch.randn(N, device=DEV, generator=gen), torch.bernoulli(x, generator=gen)

    graph, out = capture(region, generators=[gen])
    draws = []
    for _ in range(2):
        gen.manual_seed(7)
        graph.replay()
        draws.append([t.clone() for t in out])
        graph.replay()
        draws.append([t.clone() for t in out])
    assert all(torch.equal(a, b) for a, b in zip(draws[0], draws[2]))  # reseeded: the same numbers
    assert not torch.equal(draws[0][0], draws[1][0])  # not reseeded: fresh numbers
    gen.manual_seed(7)
    eager = region()
    assert all(torch.equal(a, b) for a, b in zip(draws[0], eager))


def test_unarmed_user_generator_fails_clearly_and_leaves_nothing_behind():
    gen = torch.Generator(device=DEV)
    with pytest.raises(bg.UncapturableOpError, match="generators=") as info:
        capture(lambda: torch.randn(8, device=DEV, generator=gen) + 1)
    assert "torch.randn" in str(info.value)  # the user's line
    assert not bg.is_capturing()
    torch.randn(8, device=DEV)  # eager draws still work
    torch.randn(8, device=DEV, generator=gen)
    graph, _out = capture(lambda: torch.randn(8, device=DEV) * 2)
    assert graph.draws_random_numbers


def test_breaks_draw_and_synchronize_eagerly_while_segments_capture_random_ops():
    @bg.eager_on_graph
    def jitter(h):
        torch.cuda.synchronize()  # a device-wide sync in a break stays legal
        return h + torch.rand(h.shape, device=DEV)  # drawn eagerly at every replay

    def region(t):
        noise = torch.randn(N, device=DEV)  # captured in the segment before the break
        return jitter(t + noise * 0) + torch.randn(N, device=DEV) * 0

    x = torch.zeros(N, device=DEV)  # a static input: the graph reads it, so it must stay alive
    graph, out = capture(region, x)
    assert graph.draws_random_numbers and graph.num_eager_breaks == 1
    seen = []
    for _ in range(2):
        poison_(out)
        graph.replay()
        seen.append(out.clone())
        assert 0 <= out.min().item() and out.max().item() <= 1
    assert not torch.equal(seen[0], seen[1])


def test_failed_capture_leaves_the_generator_usable():
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            torch.randn(8, device=DEV)
            raise Boom
    torch.cuda.manual_seed(1)
    torch.randn(8, device=DEV)
    graph, out = capture(lambda: torch.randn(N, device=DEV))
    first = (graph.replay(), out.clone())[1]
    graph.replay()
    assert not torch.equal(first, out)


def test_arming_on_a_stream_another_capture_is_using_is_refused_and_changes_nothing():
    """torch would leave a generator half-armed (and its pool routing open) if the keeper's
    capture could not begin: refused before anything changes, and the capture under way on
    that stream (not ours) is left open for its owner to end."""
    import breakgraph_bindings as bindings

    device = torch.device(DEV, torch.cuda.current_device())
    busy, free = torch.cuda.Stream(), torch.cuda.Stream()
    bindings.begin_capture(busy, bindings.CaptureMode.RELAXED)  # someone else's capture
    try:
        with pytest.raises(RuntimeError, match="a capture is already under way on it"):
            rng.ArmedGenerators(device, [], busy)
        assert bindings.capture_status(busy) is bindings.CaptureStatus.ACTIVE
    finally:
        bindings.end_capture(busy).destroy()
    rng.ArmedGenerators(device, [], free, wait=0.0).disarm(keep=False)  # the generator was not claimed
    graph, out = capture(lambda: torch.randn(N, device=DEV))
    first = (graph.replay(), out.clone())[1]
    graph.replay()
    assert not torch.equal(first, out)


def test_region_without_random_ops_has_no_refill_step():
    graph, _out = capture(lambda t: softmax_eager(t * 2) + 1, torch.randn(4, 8, device=DEV))
    assert not graph.draws_random_numbers


def test_arming_allocates_nothing_once_the_generator_state_exists():
    """The generator's seed and offset tensors outlive each capture's keeper (torch frees them
    when no graph is registered): a capture that draws nothing allocates no tensor."""

    def capture():
        graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(graph):
            x.add_(1)
        return graph

    x = torch.zeros(8, device=DEV)
    capture()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    capture()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_random_ops_break_mode_makes_each_random_op_a_break():
    x = torch.ones(N, device=DEV)
    graph, (noise, dropped) = capture(lambda t: (torch.randn(N, device=DEV), F.dropout(t, 0.5, True)), x, random_ops="break")
    assert graph.num_eager_breaks == 2 and not graph.draws_random_numbers
    graph.replay()
    first = noise.clone()
    graph.replay()
    assert not torch.equal(first, noise)


class Holder:
    """A thread whose capture arms the default generator and keeps it until ``release`` is set.

    Its graph is replayed only by :meth:`check`, after the thread has ended and the other
    capture with it: on torch 2.11 a graph that draws cannot replay while another capture
    holds its generator armed (torch refuses the offset increment).
    """

    def __init__(self):
        self.inside, self.release, self.errors = threading.Event(), threading.Event(), []
        self.thread = threading.Thread(target=self._capture)
        self.thread.start()
        assert self.inside.wait(60)

    def _capture(self) -> None:
        try:
            self.stream = torch.cuda.Stream()
            self.graph = bg.BreakableCUDAGraph()
            with bg.BreakableCUDAGraphCapture(self.graph, stream=self.stream, capture_error_mode="thread_local"):
                self.noise = torch.randn(N, device=DEV)
                self.inside.set()
                self.release.wait(60)
        except BaseException as error:  # pragma: no cover - reported by check()
            self.errors.append(error)
            self.inside.set()

    def join(self) -> None:
        self.release.set()
        self.thread.join()

    def check(self) -> None:
        assert not self.errors, self.errors
        with torch.cuda.stream(self.stream):
            self.graph.replay()
        self.stream.synchronize()
        assert self.noise.std().item() > 0.9


def test_a_capture_whose_generator_another_capture_holds_waits_for_it_at_its_first_random_op():
    holder = Holder()
    try:
        stream = torch.cuda.Stream()
        # Without random ops, a capture beside the holder neither waits nor splits.
        graph = bg.BreakableCUDAGraph()
        with bg.BreakableCUDAGraphCapture(graph, stream=stream, capture_error_mode="thread_local"):
            y = torch.ones(8, device=DEV) * 3
        assert graph.num_graphs == 1 and not graph.draws_random_numbers
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        assert_close(y, torch.full((8,), 3.0, device=DEV))
        # With one, it waits for the holder to end its capture, then captures it in a new segment.
        threading.Timer(0.5, holder.release.set).start()
        started = time.perf_counter()
        graph = bg.BreakableCUDAGraph()
        x = torch.ones(N, device=DEV)
        with bg.BreakableCUDAGraphCapture(graph, stream=stream, capture_error_mode="thread_local"):
            doubled = x * 2
            dropped = F.dropout(doubled, 0.5, training=True) + 1
        waited = time.perf_counter() - started
    finally:
        holder.join()
    holder.check()
    assert waited >= 0.4 and graph.draws_random_numbers and graph.num_graphs == 2
    seen = []
    for _ in range(2):
        poison_(dropped)
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        assert set(dropped.unique().tolist()) <= {1.0, 5.0}
        seen.append(dropped.clone())
    assert not torch.equal(*seen)


def test_a_capture_that_cannot_get_the_generator_in_time_fails_clearly_and_leaves_nothing_behind(monkeypatch):
    monkeypatch.setattr(recorder, "_ARMING_WAIT_S", 0.2)
    holder = Holder()
    try:
        stream = torch.cuda.Stream()
        with pytest.raises(bg.UncapturableOpError, match=r"armed by another capture \(waited 0.2 s for it\).*random_ops='break'"):
            with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), stream=stream, capture_error_mode="thread_local"):
                torch.randn(8, device=DEV)
    finally:
        holder.join()
    holder.check()
    graph, out = capture(lambda: torch.randn(N, device=DEV))  # the generator works for the next capture
    first = (graph.replay(), out.clone())[1]
    graph.replay()
    assert not torch.equal(first, out)


@pytest.mark.parametrize(
    "capture_kwargs, words",
    [
        ({"breaks": "inline"}, "a full-graph capture cannot split to wait for it"),
        ({"barrier_fn": lambda: None}, "a capture with barrier_fn does not wait"),
    ],
)
def test_captures_that_must_not_wait_for_the_generator_fail_at_once(capture_kwargs, words):
    holder = Holder()
    try:
        stream = torch.cuda.Stream()
        started = time.perf_counter()
        with pytest.raises(bg.UncapturableOpError, match=words):
            with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), stream=stream, capture_error_mode="thread_local", **capture_kwargs):
                torch.randn(8, device=DEV)
        assert time.perf_counter() - started < 5  # no wait for the holder (it holds for up to 60 s)
    finally:
        holder.join()
    holder.check()
