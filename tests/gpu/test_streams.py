"""Side streams forked from the capture stream, joined around breaks, compared with eager."""

import pytest
import torch

import breakgraph as bg
from tests.helpers import assert_close, check_against_eager, poison_

DEV = "cuda"
ORIGINALS = {
    "wait_stream": torch.cuda.Stream.__dict__["wait_stream"],
    "record": torch.cuda.Event.__dict__["record"],
    "wait": torch.cuda.Event.__dict__["wait"],
    "synchronize": torch.cuda.Event.__dict__["synchronize"],
    "query": torch.cuda.Event.__dict__["query"],
}


def _originals_back():
    assert torch.cuda.Stream.__dict__["wait_stream"] is ORIGINALS["wait_stream"]
    assert torch.cuda.Event.__dict__["record"] is ORIGINALS["record"]
    assert torch.cuda.Event.__dict__["wait"] is ORIGINALS["wait"]
    assert torch.cuda.Event.__dict__["synchronize"] is ORIGINALS["synchronize"]
    assert torch.cuda.Event.__dict__["query"] is ORIGINALS["query"]


@bg.eager_on_graph
def attention(q, k):
    return torch.softmax(q @ k.t() / 8, dim=-1) @ k


SIDE = torch.cuda.Stream() if torch.cuda.is_available() else None
SIDE2 = torch.cuda.Stream() if torch.cuda.is_available() else None


def gate_overlapping_attention(x, w):
    """The side stream computes a gate while the main stream's attention is a break."""
    main = torch.cuda.current_stream()
    SIDE.wait_stream(main)  # fork
    with torch.cuda.stream(SIDE):
        gate = torch.sigmoid(x @ w)
    y = attention(x, x)  # break while SIDE is still forked
    with torch.cuda.stream(SIDE):
        gate = gate * 2  # keeps using the side stream after the break
    main.wait_stream(SIDE)  # join
    return y * gate


def test_break_inside_an_overlap_region():
    w = torch.randn(32, 32, device=DEV) / 6
    graph, _ = check_against_eager(gate_overlapping_attention, [torch.randn(16, 32, device=DEV), w], atol=1e-4, rtol=1e-4)
    graph_segments = [s for s in graph.segments if s.kind == "graph"]
    assert graph_segments[0].side_streams == (SIDE.cuda_stream,)
    assert SIDE.cuda_stream in graph_segments[1].side_streams
    _originals_back()


def fork_join_with_events(x, w):
    main = torch.cuda.current_stream()
    forked = torch.cuda.Event()
    forked.record(main)
    SIDE.wait_event(forked)
    with torch.cuda.stream(SIDE):
        h = torch.relu(x @ w)
        done = torch.cuda.Event()
        done.record()
    y = attention(x, x)
    main.wait_event(done)
    return y + h


def test_fork_join_by_events():
    w = torch.randn(32, 32, device=DEV)
    check_against_eager(fork_join_with_events, [torch.randn(16, 32, device=DEV), w], atol=1e-4, rtol=1e-4)
    _originals_back()


def mixed(x, w):
    main = torch.cuda.current_stream()
    SIDE.wait_stream(main)
    with torch.cuda.stream(SIDE):
        a = x @ w
        ev = SIDE.record_event()
    SIDE2.wait_event(ev)  # SIDE2 forked from SIDE, itself forked from main
    with torch.cuda.stream(SIDE2):
        b = torch.tanh(a)
    y = attention(x, x)
    main.wait_stream(SIDE)
    main.wait_stream(SIDE2)
    return y + a + b


def test_mixed_wait_stream_and_events_across_two_side_streams():
    graph, _ = check_against_eager(mixed, [torch.randn(16, 32, device=DEV), torch.randn(32, 32, device=DEV) / 6], atol=1e-4, rtol=1e-4)
    first = next(s for s in graph.segments if s.kind == "graph")
    assert set(first.side_streams) == {SIDE.cuda_stream, SIDE2.cuda_stream}


def two_sides_one_joined(x):
    main = torch.cuda.current_stream()
    SIDE.wait_stream(main)
    SIDE2.wait_stream(main)
    with torch.cuda.stream(SIDE):
        a = x * 2
    with torch.cuda.stream(SIDE2):
        b = x + 3
    main.wait_stream(SIDE)  # only SIDE is joined before the break
    y = attention(x + a, x)
    main.wait_stream(SIDE2)
    return y + b


def test_two_side_streams_only_one_joined_before_a_break():
    check_against_eager(two_sides_one_joined, [torch.randn(16, 32, device=DEV)], atol=1e-4, rtol=1e-4)


def fork_join_fork(x):
    main = torch.cuda.current_stream()
    SIDE.wait_stream(main)
    with torch.cuda.stream(SIDE):
        a = x.exp()
    main.wait_stream(SIDE)
    c = a * 2
    SIDE.wait_stream(main)
    with torch.cuda.stream(SIDE):
        b = c.sin()
    y = attention(x, x)
    main.wait_stream(SIDE)
    return y + b


def test_fork_join_fork_again_before_a_break():
    check_against_eager(fork_join_fork, [torch.randn(16, 32, device=DEV)], atol=1e-4, rtol=1e-4)


def left_unjoined(x, out):
    main = torch.cuda.current_stream()
    y = attention(x, x) + 1
    SIDE.wait_stream(main)
    with torch.cuda.stream(SIDE):
        out.copy_(y * 3)  # never joined by the model
    return y


def test_side_stream_left_unjoined_at_capture_end_is_joined():
    x, out = torch.randn(16, 32, device=DEV), torch.zeros(16, 32, device=DEV)
    graph = bg.BreakableCUDAGraph()
    with bg.BreakableCUDAGraphCapture(graph):
        y = left_unjoined(x, out)
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        poison_((out, y))
        graph.replay()
        torch.cuda.synchronize()
        expected = attention(fresh, fresh) + 1
        assert_close(y, expected, 1e-4, 1e-4)
        assert_close(out, expected * 3, 1e-4, 1e-4)
    _originals_back()


# Events that cross a break. The work an event stands for is delayed on the GPU, so a
# replay that did not order its reader after it would read the buffer's old values.
SLEEP_CYCLES = 20_000_000  # about 10 ms on an H100
CROSSING = {}
KEPT_EVENT = torch.cuda.Event() if torch.cuda.is_available() else None


@bg.eager_on_graph
def produce_on_side(x, buffer, kept):
    """Writes ``buffer`` on SIDE, late, and records an event there: a new one each call, or
    one the model keeps and records again (``kept``)."""
    SIDE.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(SIDE):
        torch.cuda._sleep(SLEEP_CYCLES)
        buffer.copy_(torch.tanh(x))
    if kept:
        KEPT_EVENT.record(SIDE)
        CROSSING["done"] = KEPT_EVENT
    else:
        CROSSING["done"] = SIDE.record_event()


def wait_on_the_break_event(x, buffer, kept):
    h = x * 2
    produce_on_side(h, buffer, kept)
    g = h + 1  # ahead of the wait: free to overlap the side stream's work
    torch.cuda.current_stream().wait_event(CROSSING["done"])
    return buffer * g


@pytest.mark.parametrize("kept", [False, True], ids=["new_event_per_call", "kept_event"])
def test_a_segment_waits_on_an_event_a_break_recorded_on_a_side_stream(kept):
    x, buffer = torch.randn(256, 256, device=DEV), torch.zeros(256, 256, device=DEV)
    graph, _ = check_against_eager(lambda x, buffer: wait_on_the_break_event(x, buffer, kept), [x, buffer])
    eager_break = next(s for s in graph.segments if s.kind == "eager")
    assert eager_break.ordering.has_signals and not eager_break.ordering.runs_before
    _originals_back()


@bg.eager_on_graph
def produce_here(x, buffer):
    torch.cuda._sleep(SLEEP_CYCLES)
    buffer.copy_(torch.tanh(x))
    CROSSING["here"] = torch.cuda.current_stream().record_event()


def side_stream_waits_on_the_break(x, buffer):
    produce_here(x * 2, buffer)
    SIDE.wait_event(CROSSING["here"])  # a fork, by an event of the break's stream
    with torch.cuda.stream(SIDE):
        y = buffer * 3
    torch.cuda.current_stream().wait_stream(SIDE)
    return y


def test_a_side_stream_waits_in_a_segment_on_an_event_the_break_recorded_on_the_capture_stream():
    x, buffer = torch.randn(256, 256, device=DEV), torch.zeros(256, 256, device=DEV)
    graph, _ = check_against_eager(side_stream_waits_on_the_break, [x, buffer])
    assert SIDE.cuda_stream in graph.segments[-1].side_streams
    eager_break = next(s for s in graph.segments if s.kind == "eager")
    assert not (eager_break.ordering.runs_before or eager_break.ordering.has_signals)  # the replay stream orders it
    _originals_back()


@bg.eager_on_graph
def consume_in_break(h, on_side):
    """Reads what the segment before it wrote, once the event the segment recorded is done."""
    stream = SIDE if on_side else torch.cuda.current_stream()
    stream.wait_event(CROSSING["ready"])
    with torch.cuda.stream(stream):
        out = h * 3
    torch.cuda.current_stream().wait_stream(stream)
    return out


def break_waits_on_the_segment_event(x, on_side):
    torch.cuda._sleep(SLEEP_CYCLES)
    h = torch.tanh(x)
    CROSSING["ready"] = torch.cuda.current_stream().record_event()
    return consume_in_break(h, on_side) + 1


@pytest.mark.parametrize("on_side", [True, False], ids=["side_stream", "capture_stream"])
def test_a_break_waits_on_an_event_a_segment_recorded(on_side):
    x = torch.randn(256, 256, device=DEV)
    graph, _ = check_against_eager(lambda x: break_waits_on_the_segment_event(x, on_side), [x])
    eager_break = next(s for s in graph.segments if s.kind == "eager")
    assert (eager_break.ordering is not None and eager_break.ordering.runs_before) == on_side
    CROSSING["ready"].synchronize()  # recorded again outside the capture: usable after it
    _originals_back()


@bg.eager_on_graph
def two_streams_read_in_break(h):
    """Both side streams wait on the one event a segment recorded, and read what it stands for."""
    outs = []
    for stream, scale in ((SIDE, 3), (SIDE2, 5)):
        stream.wait_event(CROSSING["ready"])
        with torch.cuda.stream(stream):
            outs.append(h * scale)
        torch.cuda.current_stream().wait_stream(stream)
    return outs[0] + outs[1]


def two_streams_wait_on_the_segment_event(x):
    torch.cuda._sleep(SLEEP_CYCLES)
    h = torch.tanh(x)
    CROSSING["ready"] = torch.cuda.current_stream().record_event()
    return two_streams_read_in_break(h)


def test_two_streams_of_a_break_wait_on_one_event_a_segment_recorded():
    check_against_eager(two_streams_wait_on_the_segment_event, [torch.randn(256, 256, device=DEV)])
    _originals_back()


@bg.eager_on_graph
def read_after_side_stream(h):
    """Waits on SIDE, whose work on ``h`` was captured in the segment before the break."""
    SIDE2.wait_stream(SIDE)
    with torch.cuda.stream(SIDE2):
        out = h * 3
    torch.cuda.current_stream().wait_stream(SIDE2)
    return out


def side_stream_work_then_a_break_waits_on_it(x):
    SIDE.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(SIDE):
        torch.cuda._sleep(SLEEP_CYCLES)
        h = torch.tanh(x)  # left unjoined: the segment's end joins it
    return read_after_side_stream(h) + 1


def test_a_break_waits_on_a_side_stream_whose_work_a_segment_captured():
    graph, _ = check_against_eager(side_stream_work_then_a_break_waits_on_it, [torch.randn(256, 256, device=DEV)])
    eager_break = next(s for s in graph.segments if s.kind == "eager")
    assert eager_break.ordering.runs_before
    _originals_back()


@bg.eager_on_graph
def produce_on_side_without_an_event(x, buffer):
    """Writes ``buffer`` on SIDE, late, and leaves SIDE unjoined: no event, the caller waits on the stream."""
    SIDE.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(SIDE):
        torch.cuda._sleep(SLEEP_CYCLES)
        buffer.copy_(torch.tanh(x))


def wait_on_the_stream_a_break_used(x, buffer, waiter, breaks_after):
    h = x * 2  # kept alive: SIDE reads it late
    produce_on_side_without_an_event(h, buffer)
    g = h + 1  # ahead of the wait: free to overlap the side stream's work
    for _ in range(breaks_after):
        g = attention(g, g)  # a later break that does not touch SIDE
    main = torch.cuda.current_stream()
    if waiter == "capture_stream":
        main.wait_stream(SIDE)
        return buffer * g
    SIDE2.wait_stream(main)  # a side stream of the segment waits on SIDE, and the capture stream on it
    SIDE2.wait_stream(SIDE)
    with torch.cuda.stream(SIDE2):
        out = buffer * g
    main.wait_stream(SIDE2)
    return out


@pytest.mark.parametrize("breaks_after", [0, 1], ids=["latest_break", "earlier_break"])
@pytest.mark.parametrize("waiter", ["capture_stream", "side_stream"])
def test_a_segment_waits_on_a_side_stream_a_break_worked_on(waiter, breaks_after):
    x, buffer = torch.randn(256, 256, device=DEV) / 16, torch.zeros(256, 256, device=DEV)
    graph, _ = check_against_eager(
        lambda x, buffer: wait_on_the_stream_a_break_used(x, buffer, waiter, breaks_after), [x, buffer], atol=1e-4, rtol=1e-4
    )
    latest_break = [s for s in graph.segments if s.kind == "eager"][-1]
    assert latest_break.ordering.has_signals and not latest_break.ordering.runs_before
    _originals_back()


@bg.eager_on_graph
def result_on_side_left_unjoined(x, kind):
    """Returns what SIDE computes, late, and leaves SIDE unjoined: the caller waits on the
    stream before reading the result, as eager code may. ``after_join``: SIDE's first work is
    joined, then SIDE makes the result (work the hooks do not see)."""
    SIDE.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(SIDE):
        torch.cuda._sleep(SLEEP_CYCLES)
        result = torch.tanh(x)
    if kind == "after_join":
        torch.cuda.current_stream().wait_stream(SIDE)
        with torch.cuda.stream(SIDE):
            torch.cuda._sleep(SLEEP_CYCLES)
            result = result * 3
    if kind == "dict":
        with torch.cuda.stream(SIDE):
            result = {"tanh": result, "sum": result.sum(0)}
    return result


def read_a_result_left_on_a_side_stream(x, kind):
    h = x * 2  # kept alive to the end: SIDE reads it late
    out = result_on_side_left_unjoined(h, kind)
    g = h + 1  # ahead of the wait: free to overlap the side stream's work
    torch.cuda.current_stream().wait_stream(SIDE)
    return out["tanh"] * g + out["sum"] if kind == "dict" else out * g


@pytest.mark.parametrize("kind", ["tensor", "dict", "after_join"])
def test_a_break_result_computed_on_a_side_stream_it_left_unjoined_is_written_back_after_that_work(kind):
    x = torch.randn(256, 256, device=DEV)
    graph, _ = check_against_eager(lambda x: read_a_result_left_on_a_side_stream(x, kind), [x], atol=1e-4, rtol=1e-4)
    eager_break = next(s for s in graph.segments if s.kind == "eager")
    assert eager_break.ordering.orders_writeback and eager_break.ordering.has_signals
    _originals_back()


def use_the_side_stream_after_the_break(x, buffer, how):
    main = torch.cuda.current_stream()
    h = x * 2  # every tensor SIDE reads stays alive to the end
    if how == "carried":
        SIDE.wait_stream(main)
        with torch.cuda.stream(SIDE):
            g = h + 1  # left unjoined: SIDE is carried across the break
    else:
        g = h - 1
    produce_on_side_without_an_event(g, buffer)
    if how == "forked_again":
        SIDE.wait_stream(main)
    with torch.cuda.stream(SIDE):
        out = buffer * g  # by SIDE's own order, after the break's work on it
    main.wait_stream(SIDE)
    return out


@pytest.mark.parametrize("how", ["forked_again", "carried"])
def test_a_segment_using_a_side_stream_a_break_worked_on_follows_that_work(how):
    x, buffer = torch.randn(256, 256, device=DEV), torch.zeros(256, 256, device=DEV)
    graph, _ = check_against_eager(lambda x, buffer: use_the_side_stream_after_the_break(x, buffer, how), [x, buffer])
    eager_break = next(s for s in graph.segments if s.kind == "eager")
    assert eager_break.ordering.has_signals
    _originals_back()


def test_a_wait_on_a_stream_outside_the_capture_before_any_break_is_refused_and_the_next_capture_works():
    x = torch.randn(64, 64, device=DEV)
    with pytest.raises(bg.StreamJoinError, match="no break queued work that breakgraph saw"):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            x.add_(1)
            torch.cuda.current_stream().wait_stream(SIDE)
    _originals_back()
    test_break_inside_an_overlap_region()


PINNED = torch.empty(256, pin_memory=True) if torch.cuda.is_available() else None


@bg.eager_on_graph
def read_the_host_copy(x, how):
    """Waits on the host for the event a segment recorded after its copy to the host, then reads the copy."""
    copied = CROSSING["copied"]
    if how == "synchronize":
        copied.synchronize()
    else:
        while not copied.query():
            pass
    host_values = PINNED.clone()  # read by the host, now: a copy on the GPU would wait for the graphs anyway
    return x + host_values.to(x.device)


def copy_to_the_host_then_read_it_in_a_break(x, how):
    torch.cuda._sleep(SLEEP_CYCLES)
    PINNED.copy_(torch.tanh(x), non_blocking=True)  # captured: each replay copies anew, late
    CROSSING["copied"] = torch.cuda.current_stream().record_event()
    return read_the_host_copy(x, how)


@pytest.mark.parametrize("how", ["synchronize", "query"])
def test_a_break_waits_on_the_host_for_an_event_a_segment_recorded(how):
    graph, _ = check_against_eager(lambda x: copy_to_the_host_then_read_it_in_a_break(x, how), [torch.randn(256, device=DEV)])
    eager_break = next(s for s in graph.segments if s.kind == "eager")
    assert eager_break.ordering.runs_before and not eager_break.ordering.has_signals
    _originals_back()


@bg.eager_on_graph
def scale_after_generic_waits(h, ready):
    """A break that orders its side stream after torch's device-generic current stream and a
    segment's event."""
    SIDE2.wait_stream(torch.accelerator.current_stream())
    ready.wait(SIDE2)
    with torch.cuda.stream(SIDE2):
        out = h * 3
    torch.cuda.current_stream().wait_stream(SIDE2)
    return out


def generic_streams_around_a_break(x):
    """``torch.accelerator.current_stream()``, a ``torch.Stream``, given to the CUDA methods, as
    their signatures allow: a fork, an event's record, and a break's waits."""
    main = torch.accelerator.current_stream()
    SIDE.wait_stream(main)
    with torch.cuda.stream(SIDE):
        torch.cuda._sleep(SLEEP_CYCLES)
        gate = torch.sigmoid(x)  # carried across the break, joined after it
    h = torch.tanh(x)
    ready = torch.cuda.Event()
    ready.record(main)
    y = scale_after_generic_waits(h, ready)
    torch.cuda.current_stream().wait_stream(SIDE)
    return y * gate


def test_torchs_device_generic_streams_given_to_the_hooked_methods_are_tracked():
    graph, _ = check_against_eager(generic_streams_around_a_break, [torch.randn(256, 256, device=DEV)])
    first = next(s for s in graph.segments if s.kind == "graph")
    eager_break = next(s for s in graph.segments if s.kind == "eager")
    assert first.side_streams == (SIDE.cuda_stream,)
    assert eager_break.ordering.runs_before
    _originals_back()


def test_a_gpus_generic_stream_is_taken_as_the_capture_stream():
    chosen = torch.cuda.Stream(priority=-1)  # torch's high-priority pool: not SIDE or SIDE2, which the body forks
    generic = torch.Stream(stream_id=chosen.stream_id, device_index=chosen.device_index, device_type=chosen.device_type)
    assert type(generic) is torch.Stream and chosen.cuda_stream not in (SIDE.cuda_stream, SIDE2.cuda_stream)
    captured_on = []

    def body(x):
        if torch.cuda.is_current_stream_capturing():
            captured_on.append(torch.cuda.current_stream().cuda_stream)
        return generic_streams_around_a_break(x)

    graph, _ = check_against_eager(body, [torch.randn(256, 256, device=DEV)], stream=generic)
    assert captured_on == [chosen.cuda_stream]
    assert graph.segments[0].kind == "graph"
    _originals_back()


def test_original_methods_restored_after_failed_capture():
    with pytest.raises(ZeroDivisionError):
        with bg.BreakableCUDAGraphCapture(bg.BreakableCUDAGraph()):
            SIDE.wait_stream(torch.cuda.current_stream())
            assert torch.cuda.Stream.__dict__["wait_stream"] is not ORIGINALS["wait_stream"]
            1 / 0
    _originals_back()
    # The side stream is usable again, and the next capture with it works.
    test_break_inside_an_overlap_region()


def test_hooks_pass_through_outside_capture():
    a = torch.randn(1000, device=DEV)
    SIDE.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(SIDE):
        b = a * 2
    torch.cuda.current_stream().wait_stream(SIDE)
    assert_close(b, a * 2)
    _originals_back()
