"""Random ops captured inside graph segments, in segments torch captures: fresh numbers at
every replay, the right distribution, the generator's offsets exactly as under
torch.cuda.graph and as eager, user generators, and captures that meet each other."""

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import breakgraph as bg
from breakgraph.recording import recorder, rng
from tests.helpers import assert_close, poison_, use_watch

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


@pytest.mark.parametrize("watch", ["dispatch key", "dispatch mode"])
def test_random_ops_are_captured_with_no_extra_breaks_and_draw_fresh_numbers(monkeypatch, watch):
    use_watch(monkeypatch, watch)
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


def test_the_default_generator_and_a_users_in_one_capture():
    gen = torch.Generator(device=DEV)
    x = torch.full((N,), 0.75, device=DEV)

    def region():
        return torch.randn(N, device=DEV, generator=gen), torch.rand(N, device=DEV), torch.bernoulli(x, generator=gen)

    graph, out = capture(region, generators=[gen])
    draws = []
    for _ in range(2):
        gen.manual_seed(7), torch.cuda.manual_seed(8)
        graph.replay()
        draws.append([t.clone() for t in out])
        graph.replay()
        draws.append([t.clone() for t in out])
    assert all(torch.equal(a, b) for a, b in zip(draws[0], draws[2]))  # reseeded: the same numbers
    assert all(not torch.equal(a, b) for a, b in zip(draws[0], draws[1]))  # not reseeded: fresh numbers
    gen.manual_seed(7), torch.cuda.manual_seed(8)
    eager = region()
    assert all(torch.equal(a, b) for a, b in zip(draws[0], eager))


@pytest.mark.skipif(
    not rng.registers_generators_explicitly(torch.__version__), reason="torch 2.14 registers a generator at its first draw"
)
def test_a_user_generator_not_passed_fails_clearly_and_leaves_nothing_behind():
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


def test_region_without_random_ops_has_no_segment_torch_replays():
    graph, _out = capture(lambda t: softmax_eager(t * 2) + 1, torch.randn(4, 8, device=DEV))
    assert not graph.draws_random_numbers and graph.num_graphs == 2


def test_random_ops_break_mode_makes_each_random_op_a_break():
    x = torch.ones(N, device=DEV)
    graph, (noise, dropped) = capture(lambda t: (torch.randn(N, device=DEV), F.dropout(t, 0.5, True)), x, random_ops="break")
    assert graph.num_eager_breaks == 2 and not graph.draws_random_numbers
    graph.replay()
    first = noise.clone()
    graph.replay()
    assert not torch.equal(first, noise)


class Holder:
    """A thread whose capture draws from the default generator in a segment it keeps open
    until ``release`` is set.

    Its graph is replayed only by :meth:`check`, after the thread has ended and the other
    capture with it: on torch 2.11 a graph that draws cannot replay while another capture's
    segment draws from its generator (torch refuses the offset increment).
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


def test_a_capture_whose_generator_another_captures_segment_holds_waits_for_it_at_its_first_random_op():
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
    assert waited >= 0.4 and graph.draws_random_numbers and graph.num_graphs == 1  # the multiply launched with the dropout
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
    monkeypatch.setattr(recorder, "_GENERATOR_WAIT_S", 0.2)
    holder = Holder()
    try:
        stream = torch.cuda.Stream()
        with pytest.raises(bg.UncapturableOpError, match=r"drawn from by another capture \(waited 0.2 s for it\).*random_ops='break'"):
            with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph(), stream=stream, capture_error_mode="thread_local"):
                torch.randn(8, device=DEV)
    finally:
        holder.join()
    holder.check()
    graph, out = capture(lambda: torch.randn(N, device=DEV))  # the generator works for the next capture
    first = (graph.replay(), out.clone())[1]
    graph.replay()
    assert not torch.equal(first, out)


def test_a_capture_with_barrier_fn_does_not_wait_for_the_generator():
    holder = Holder()
    try:
        stream = torch.cuda.Stream()
        started = time.perf_counter()
        with pytest.raises(bg.UncapturableOpError, match="a capture with barrier_fn does not wait"):
            with bg.BreakableCUDAGraphCapture(
                bg.BreakableCUDAGraph(), stream=stream, capture_error_mode="thread_local", barrier_fn=lambda: None
            ):
                torch.randn(8, device=DEV)
        assert time.perf_counter() - started < 5  # no wait for the holder (it holds for up to 60 s)
    finally:
        holder.join()
    holder.check()


def test_a_full_graph_with_dropout_draws_fresh_masks_equal_to_eagers_and_has_no_break():
    x = torch.randn(N, device=DEV)
    w = torch.randn(N, device=DEV)

    def region():
        h = F.dropout(x * w, 0.5, training=True)
        return F.dropout(h + 1, 0.25, training=True)

    graph, out = capture(region, breaks="inline")
    assert graph.num_eager_breaks == 0 and graph.draws_random_numbers
    assert graph.num_graphs == 1  # the part before the first random op is launched as part of the rest
    masks = []
    for seed in (5, 6, 5):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_(out)
        torch.cuda.manual_seed(seed)
        graph.replay()
        torch.cuda.manual_seed(seed)
        expected = region()
        assert torch.equal(out, expected)
        masks.append(out != 0)
    assert not torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])


def test_a_random_op_and_a_break_under_a_side_stream_are_captured_on_the_capture_stream():
    """torch begins and ends its captures on the current stream: a segment whose first random
    op runs on a side stream, and one a break ends while the side stream is current, are still
    begun and ended on the capture stream, and replay draws what eager draws."""
    x = torch.randn(N, device=DEV)
    side = torch.cuda.Stream()

    def region():
        h = x * 2
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dropped = F.dropout(h, 0.5, training=True)
            mixed = softmax_eager(dropped[:64].view(8, 8))  # a break while the side stream is current
            more = F.dropout(dropped + 1, 0.25, training=True)
        torch.cuda.current_stream().wait_stream(side)
        return dropped, mixed, more + h

    graph, out = capture(region)
    assert graph.num_eager_breaks == 1 and graph.draws_random_numbers
    for seed in (5, 6):
        x.copy_(torch.randn_like(x))
        poison_(out)
        torch.cuda.manual_seed(seed)
        graph.replay()
        torch.cuda.manual_seed(seed)
        expected = region()
        torch.cuda.synchronize()
        for got, want in zip(out, expected):
            assert torch.equal(got, want)


def test_a_training_step_with_dropout_is_bit_exact_against_eager_over_ten_steps():
    def make():
        torch.manual_seed(0)
        layers = [nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 16)]
        return nn.Sequential(*layers).to(DEV)

    model, reference = make(), make()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference))
    x, y = torch.randn(32, 64, device=DEV), torch.randn(32, 16, device=DEV)

    def step(net, optimizer, inputs, targets):
        optimizer.zero_grad(set_to_none=False)
        loss = F.mse_loss(net(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (the optimizer's state exists before the capture)
        step(model, opt, x, y), step(reference, ref_opt, x, y)
    torch.cuda.current_stream().wait_stream(stream)
    reference.load_state_dict(model.state_dict())
    graph, loss = capture(lambda: step(model, opt, x, y), stream=stream)
    assert graph.num_eager_breaks == 0 and graph.draws_random_numbers
    reference.load_state_dict(model.state_dict())  # capture changed no weight
    torch.cuda.manual_seed(11)
    for _ in range(10):
        fresh_x, fresh_y = torch.randn_like(x), torch.randn_like(y)
        x.copy_(fresh_x), y.copy_(fresh_y)
        state = torch.cuda.get_rng_state()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.replay()
        torch.cuda.set_rng_state(state)
        with torch.cuda.stream(stream):  # the same stream, so cuBLAS picks the same kernels
            ref_loss = step(reference, ref_opt, fresh_x, fresh_y)
        stream.synchronize()
        assert torch.equal(loss, ref_loss), (loss.item(), ref_loss.item())
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q), (p - q).abs().max().item()


def watching_captures(monkeypatch) -> list:
    """Every capture that switches the op watch on from now on."""
    from breakgraph.recording import recorder

    seen, watch_ops = [], recorder.watch_ops

    def counting(capture):
        seen.append(capture)
        return watch_ops(capture)

    monkeypatch.setattr(recorder, "watch_ops", counting)
    return seen


def test_a_callable_whose_warm_up_draws_nothing_is_captured_without_the_op_watch(monkeypatch):
    seen = watching_captures(monkeypatch)
    x = torch.randn(4, 8, device=DEV)
    plain = bg.graphed(lambda t: softmax_eager(t * 2) + 1, x)
    assert plain.draws_random_numbers is False and not plain.graph.draws_random_numbers and not seen
    noisy = bg.graphed(lambda t: F.dropout(t, 0.5, training=True) + 1, x)
    assert noisy.draws_random_numbers and noisy.graph.draws_random_numbers and seen


def test_a_callable_that_draws_where_its_warm_up_did_not_is_captured_again_with_the_watch():
    x = torch.ones(N, device=DEV)
    step = bg.graphed(lambda t: F.dropout(t, 0.5, training=True), x, warmup=0)  # nothing seen it draw
    assert step.draws_random_numbers and step.graph.draws_random_numbers
    first = step().clone()
    assert set(first.unique().tolist()) <= {0.0, 2.0}
    assert not torch.equal(first, step())


def test_a_runners_sizes_after_the_first_are_watched_when_the_first_drew(monkeypatch):
    from breakgraph.graphs.graphed import GraphedCallable

    attempts = []
    capture_on = GraphedCallable._capture_on

    def counted(self, stream, target, unwatched):
        attempts.append(unwatched)
        return capture_on(self, stream, target, unwatched)

    monkeypatch.setattr(GraphedCallable, "_capture_on", counted)
    x = torch.ones(8, N, device=DEV)
    runner = bg.GraphRunner(lambda t: F.dropout(t, 0.5, training=True) * 3, x, [2, 4, 8], progress=False).capture()
    assert attempts == [False, False, False]  # the first size's warm-up drew: no size tried without the watch
    for n in (1, 3, 8):
        first = runner(x[:n]).clone()
        assert set(first.unique().tolist()) <= {0.0, 6.0} and not torch.equal(first, runner(x[:n]))
