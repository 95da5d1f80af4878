"""State-machine tests of the fork/join tracker against a simulated CUDA capture (no GPU)."""

import gc
import itertools
import weakref

import pytest
import torch

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from breakgraph_bindings import CaptureInfo, CaptureStatus, CudaError
from breakgraph.recording import break_ordering
from breakgraph.recording.dispatch import clearer_error
from breakgraph.recording.streams import ForkJoinTracker, StreamJoinError, unseen_fork


class RecordedBreak:
    """A break's segment, as far as the tracker sees it."""

    ordering = None

    def __init__(self, writes_back=False):
        self.writes_back = writes_back


def end_break(tracker, writes_back=False):
    """End the running break, recorded as a segment; return what its replay orders."""
    recorded = RecordedBreak(writes_back)
    tracker.break_ended(recorded)
    return recorded.ordering


@pytest.fixture(autouse=True)
def events_without_a_gpu(monkeypatch):
    """The events a break's ordering makes, without CUDA."""
    monkeypatch.setattr(break_ordering.bindings, "Event", FakeEvent)


class FakeStream:
    device_index = 0

    def __init__(self, handle):
        self.cuda_stream = handle

    def __repr__(self):
        return f"S{self.cuda_stream:#x}"


class FakeEvent:
    from_break = False


class SimulatedCapture:
    """CUDA's capture rules, small: nodes, per-stream dependency frontiers, joins."""

    def __init__(self, origin):
        self.origin = origin
        self.capture_id = 0
        self.ids = itertools.count(1)
        self.start()

    def start(self):
        self.capture_id += 1
        self.parents = {}  # node -> parents
        self.frontier = {self.origin.cuda_stream: frozenset()}  # capturing streams only

    def capturing(self, stream):
        return stream.cuda_stream in self.frontier

    def info(self, stream):
        if not self.capturing(stream):
            return CaptureInfo(CaptureStatus.NONE)
        return CaptureInfo(CaptureStatus.ACTIVE, self.capture_id, tuple(sorted(self.frontier[stream.cuda_stream])))

    def launch(self, stream):
        if self.capturing(stream):
            node = next(self.ids)
            self.parents[node] = self.frontier[stream.cuda_stream]
            self.frontier[stream.cuda_stream] = frozenset({node})

    def wait(self, waiter, deps, source_capturing):
        if source_capturing:
            current = self.frontier.get(waiter.cuda_stream, frozenset())
            self.frontier[waiter.cuda_stream] = current | deps

    def wait_stream(self, waiter, source):
        self.wait(waiter, self.frontier.get(source.cuda_stream, frozenset()), self.capturing(source))

    def ancestors(self, nodes):
        seen, todo = set(), list(nodes)
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(self.parents[node])
        return seen

    def unjoined(self):
        """Nodes the origin stream does not (transitively) wait on: cudaErrorStreamCaptureUnjoined."""
        return set(self.parents) - self.ancestors(self.frontier[self.origin.cuda_stream])


class TrackerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.main = FakeStream(0x100)
        self.sides = [FakeStream(0x200 + i) for i in range(3)]
        self.sim = SimulatedCapture(self.main)
        self.joins = []
        self.tracker = ForkJoinTracker(
            self.main, self.sim.info, join=self._join, fork=self._fork, record=self._record, wait_external=self._wait_external
        )
        self.tracker.segment_begun()
        self.events = {}
        self.breaks = []  # the breaks' segments, with what they keep for replay
        self.external_waits = []
        self.took_part = set()  # side streams that took part in an ended segment
        self.last_break_on = {}  # side stream -> the number of the latest break that waited or recorded on it
        self.signal_waits = {}  # event-wait node of the open segment -> (stream, break number) whose work it waits for
        self.waited_before = {}  # side stream -> the latest break whose work on it an ended segment's graph waited for

    def _join(self, capture_stream, side):
        assert capture_stream is self.main
        self.joins.append(side.cuda_stream)
        self.sim.wait_stream(capture_stream, side)

    def _fork(self, side, capture_stream):
        self.sim.wait_stream(side, capture_stream)

    def _record(self, event, stream):  # in a break: the capture stream is not capturing
        assert stream is self.main and not self.sim.capturing(stream)
        event.deps, event.capturing, event.from_break = frozenset(), False, True

    def _wait_external(self, stream, event):  # an event-wait node on a capturing stream
        assert self.sim.capturing(stream) and isinstance(event, FakeEvent)
        orderings = [recorded.ordering for recorded in self.breaks if recorded.ordering is not None]
        assert any(event is signal for ordering in orderings for _, signal in ordering._signals.values()), (
            "a graph waits on an event no break's replay records"
        )
        self.sim.launch(stream)
        self.external_waits.append((stream, event))
        for number, recorded in enumerate(self.breaks, 1):
            for sid, (_, signal) in (recorded.ordering._signals.items() if recorded.ordering else ()):
                if signal is event:
                    self.signal_waits[next(iter(self.sim.frontier[stream.cuda_stream]))] = (sid, number)

    def follows_break_work(self, waiter, source):
        """Whether ``waiter``'s next work comes after what breaks queued on ``source``: an ended
        segment's graph waited for it (later graphs follow that one), or an event-wait node
        ``waiter`` depends on in this one."""
        need = self.last_break_on.get(source.cuda_stream)
        if need is None or self.waited_before.get(source.cuda_stream, 0) >= need:
            return True
        ancestors = self.sim.ancestors(self.sim.frontier.get(waiter.cuda_stream, ()))
        waits = [self.signal_waits[node] for node in ancestors if node in self.signal_waits]
        return any(sid == source.cuda_stream and number >= need for sid, number in waits)

    streams = st.integers(0, 3)

    def stream(self, i):
        return self.main if i == 3 else self.sides[i]

    # The hooks' behaviour, replayed against the simulation.
    def wait_stream(self, waiter, source):
        known = source.cuda_stream in self.last_break_on or source.cuda_stream in self.took_part
        if self.sim.capturing(waiter) and not self.sim.capturing(source) and not known:
            with pytest.raises(StreamJoinError, match="no break queued work that breakgraph saw"):
                self.tracker.waited_on_uncaptured_stream(waiter, source)
            return
        if self.tracker.waited_on_uncaptured_stream(waiter, source):
            assert self.follows_break_work(waiter, source), "a wait on a stream a break used does not follow that work"
            return
        # CUDA refuses a capturing stream's wait on work outside the capture
        assert self.sim.capturing(source) or not self.sim.capturing(waiter), "a wait on an uncaptured stream reached CUDA"
        self.sim.wait_stream(waiter, source)
        self.tracker.stream_waited(waiter, source)

    @rule(i=streams)
    def launch(self, i):
        self.sim.launch(self.stream(i))

    @rule(i=st.integers(0, 2))
    def fork(self, i):
        self.wait_stream(self.sides[i], self.main)

    @rule(i=st.integers(0, 2))
    def join(self, i):
        self.wait_stream(self.main, self.sides[i])

    @rule(i=st.integers(0, 2), j=st.integers(0, 2))
    def chain(self, i, j):
        self.wait_stream(self.sides[i], self.sides[j])

    @rule(i=streams, name=st.integers(0, 2))
    def record_event(self, i, name):
        stream = self.stream(i)
        event = self.events.setdefault(name, FakeEvent())  # re-recording replaces what it stood for
        event.deps = self.sim.frontier.get(stream.cuda_stream, frozenset())
        event.capturing, event.from_break = self.sim.capturing(stream), False
        self.tracker.event_recorded(event, stream)

    @precondition(lambda self: self.events)
    @rule(i=streams, name=st.integers(0, 2))
    def wait_event(self, i, name):
        event = self.events.get(name)
        if event is None:
            return
        stream = self.stream(i)
        if self.tracker.waited_in_segment(event, stream):
            return
        # CUDA refuses a capturing stream's wait on an event a break recorded
        assert not (event.from_break and self.sim.capturing(stream)), "a wait on a break's event reached CUDA"
        self.sim.wait(stream, event.deps, event.capturing)
        self.tracker.event_waited(event, stream)

    @rule(
        in_break=st.lists(st.tuples(st.sampled_from(["record", "wait", "queue", "join"]), streams, st.integers(0, 2)), max_size=5),
        writes_back=st.booleans(),
    )
    def segment_boundary(self, in_break, writes_back):
        """A segment ends, a break records and waits on events, queues work on streams and
        joins them (eagerly), the next begins. A later segment that waits on or forks a stream
        the break queued work on must wait on a signal the latest break records; a break that
        writes a result back waits first for every side stream it queued work on, joined or
        not (it may queue more there after a join, unseen)."""
        self.joins.clear()
        self.tracker.segment_ending()
        assert not self.sim.unjoined(), "a forked stream was left unjoined at the segment end"
        assert len(self.joins) == len(set(self.joins)), f"duplicate joins {self.joins}"
        self.took_part |= set(self.sim.frontier) - {self.main.cuda_stream}
        for sid, number in self.signal_waits.values():  # the graph ends after its event-wait nodes
            self.waited_before[sid] = max(self.waited_before.get(sid, 0), number)
        self.signal_waits.clear()
        self.sim.start()
        self.sim.frontier.clear()  # between segments nothing captures
        self.tracker.break_begun()
        worked_on = set()  # the side streams this break queues work on
        for action, i, name in in_break:
            stream = self.stream(i)
            if action == "join":  # current.wait_stream(stream)
                self.tracker.breaks.stream_waited(self.main, stream)
                continue
            if stream is not self.main and (action != "wait" or name in self.events):
                self.last_break_on[stream.cuda_stream] = len(self.breaks) + 1  # the break waits or records on it
                worked_on.add(stream.cuda_stream)
            if action == "queue":  # stream.wait_stream(current) before queuing work on it
                self.tracker.breaks.stream_waited(stream, self.main)
            elif action == "record":
                event = self.events.setdefault(name, FakeEvent())
                event.deps, event.capturing, event.from_break = frozenset(), False, True
                self.tracker.breaks.event_recorded(event, stream)
            elif name in self.events:
                event = self.events[name]
                handled = self.tracker.breaks.event_waited(event, stream)
                # CUDA refuses an eager wait on an event a capture recorded
                assert handled or not event.capturing, "a break's wait on a captured event reached CUDA"
        self.breaks.append(RecordedBreak(writes_back))
        self.tracker.break_ended(self.breaks[-1])
        ordering = self.breaks[-1].ordering
        waited_before_writeback = set(ordering._writeback_waits) if ordering is not None else set()
        assert waited_before_writeback == (worked_on if writes_back else set()), "the writeback does not wait for the break's side streams"
        self.sim.frontier[self.main.cuda_stream] = frozenset()
        self.tracker.segment_begun()

    @invariant()
    def a_stream_in_a_segment_follows_the_breaks_work_on_it(self):
        for side in self.sides:
            if self.sim.capturing(side):
                assert self.follows_break_work(side, side), f"{side} takes part in a segment before the breaks' work on it"

    @invariant()
    def open_streams_are_capturing(self):
        for sid in self.tracker.open_streams:
            assert sid in self.sim.frontier


TrackerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_tracker_state_machine = TrackerMachine.TestCase


def test_carried_stream_is_forked_again_after_the_break():
    main, side = FakeStream(1), FakeStream(2)
    sim = SimulatedCapture(main)
    forks = []
    tracker = ForkJoinTracker(main, sim.info, join=lambda c, s: sim.wait_stream(c, s), fork=lambda s, c: (forks.append(s), sim.wait_stream(s, c)))
    tracker.segment_begun()
    sim.wait_stream(side, main)
    tracker.stream_waited(side, main)
    sim.launch(side)
    assert tracker.segment_ending() == (2,)
    assert not sim.unjoined()
    sim.start()
    tracker.segment_begun()
    assert forks == [side] and sim.capturing(side)


def test_joined_stream_without_new_work_is_not_joined_again():
    main, side = FakeStream(1), FakeStream(2)
    sim = SimulatedCapture(main)
    joins = []
    tracker = ForkJoinTracker(main, sim.info, join=lambda c, s: joins.append(s), fork=lambda s, c: None)
    tracker.segment_begun()
    sim.wait_stream(side, main)
    tracker.stream_waited(side, main)
    sim.launch(side)
    sim.wait_stream(main, side)
    tracker.stream_waited(main, side)
    tracker.segment_ending()
    assert joins == []


def test_events_recorded_into_segments_live_until_the_capture_ends():
    """The user drops an event a segment recorded while a later segment captures on its stream:
    the tracker holds it until the whole capture has ended. Events recorded outside it are not held."""
    main, outside = FakeStream(1), FakeStream(9)
    sim = SimulatedCapture(main)
    tracker = ForkJoinTracker(main, sim.info, join=lambda c, s: sim.wait_stream(c, s), fork=lambda s, c: sim.wait_stream(s, c))
    tracker.segment_begun()
    recorded, not_captured = FakeEvent(), FakeEvent()
    tracker.event_recorded(recorded, main)
    tracker.event_recorded(not_captured, outside)
    kept, gone = weakref.ref(recorded), weakref.ref(not_captured)
    tracker.segment_ending()
    sim.start()
    tracker.segment_begun()
    del recorded, not_captured  # dropped by the user while the next segment captures
    gc.collect()
    assert kept() is not None and gone() is None
    tracker.segment_ending()
    tracker.capture_ended()
    gc.collect()
    assert kept() is None


def test_a_hook_entered_before_the_last_capture_ends_still_finds_torchs_method():
    """Hooks read the saved originals without the lock; removing the hooks must not take them away."""
    from breakgraph.recording import stream_hooks

    original = torch.cuda.Stream.__dict__["wait_stream"]
    stream_hooks.install_hooks()
    hooked = torch.cuda.Stream.__dict__["wait_stream"]
    stream_hooks.remove_hooks()  # another thread's last capture ends while this hook is under way
    assert hooked is not original and torch.cuda.Stream.__dict__["wait_stream"] is original
    with pytest.raises(Exception) as raised:
        hooked(object(), object())  # outside a capture: reaches torch's method, which refuses these
    assert not isinstance(raised.value, KeyError)


def test_a_break_orders_the_events_that_cross_its_boundaries():
    """A segment's event waited on by a side stream in the break: the side stream follows the
    replay stream before the break. A break's event on a side stream waited on in the next
    segment: an event-wait node on the event the break's replay records there. A break whose
    events cross nothing orders nothing."""
    main, side = FakeStream(1), FakeStream(2)
    sim = SimulatedCapture(main)
    forks, records, waits = [], [], []
    tracker = ForkJoinTracker(
        main,
        sim.info,
        join=lambda c, s: None,
        fork=lambda s, c: forks.append(s),
        record=lambda e, s: records.append((e, s)),
        wait_external=lambda s, e: waits.append((s, e)),
    )
    tracker.segment_begun()
    ready = FakeEvent()
    tracker.event_recorded(ready, main)
    tracker.segment_ending()
    sim.start()
    tracker.break_begun()
    done = FakeEvent()
    tracker.breaks.event_recorded(done, side)
    assert tracker.breaks.event_waited(ready, side)
    ordering = end_break(tracker)
    assert forks == [side] and records == [(ready, main)]  # the side stream follows; the event is usable again
    assert ordering.runs_before and not ordering.has_signals
    tracker.segment_begun()
    assert tracker.waited_in_segment(done, main)
    assert waits == [(main, ordering.signal_on(side.cuda_stream))] and ordering.has_signals
    assert tracker.waited_in_segment(ready, main) and len(waits) == 1  # an earlier segment's: followed, no node
    tracker.segment_ending()
    sim.start()
    tracker.break_begun()
    assert end_break(tracker) is None


def tracker_between_segments():
    """A tracker, its simulated capture, and what it asked of CUDA, after one segment in which
    ``side`` took part and recorded ``ready``; a break is running. Records raise while
    ``log["refused"]`` holds a count of them to refuse."""
    main, side = FakeStream(1), FakeStream(2)
    sim = SimulatedCapture(main)
    log = {"forks": [], "records": [], "waits": [], "sim": sim, "refused": 0}

    def record(event, stream):
        if log["refused"]:
            log["refused"] -= 1
            raise RuntimeError("record refused")
        log["records"].append((event, stream))

    tracker = ForkJoinTracker(
        main,
        sim.info,
        join=lambda c, s: sim.wait_stream(c, s),
        fork=lambda s, c: log["forks"].append(s),
        record=record,
        wait_external=lambda s, e: log["waits"].append((s, e)),
    )
    tracker.segment_begun()
    sim.wait_stream(side, main)
    tracker.stream_waited(side, main)
    ready = FakeEvent()
    tracker.event_recorded(ready, side)
    tracker.segment_ending()
    sim.start()
    tracker.break_begun()
    return tracker, main, side, ready, log


def test_every_wait_in_breaks_on_a_segments_event_is_ordered():
    """Two streams of one break, and a stream of a later break, wait on one segment's event:
    each follows the replay stream; the event is recorded again once."""
    tracker, main, side, ready, log = tracker_between_segments()
    first, second, later = FakeStream(3), FakeStream(4), FakeStream(5)
    assert tracker.breaks.event_waited(ready, first) and tracker.breaks.event_waited(ready, second)
    ordering = end_break(tracker)
    tracker.segment_begun()
    tracker.segment_ending()
    tracker.break_begun()
    assert tracker.breaks.event_waited(ready, later)
    assert ordering._followers.keys() == {3, 4} and end_break(tracker)._followers.keys() == {5}
    assert log["records"] == [(ready, main)]
    assert [stream for stream in log["forks"] if stream is not side] == [first, second, later]  # side: carried


def test_a_segments_event_whose_record_again_failed_is_recorded_again_at_the_next_wait():
    """A break's record of a segment's event raised (the caller went on past it): the next
    wait on that event records it again, rather than taking it as recorded."""
    tracker, main, side, ready, log = tracker_between_segments()
    log["refused"] = 1
    with pytest.raises(RuntimeError, match="record refused"):
        tracker.breaks.event_waited(ready, FakeStream(3))
    tracker.break_discarded()
    tracker.segment_begun()
    tracker.segment_ending()
    tracker.break_begun()
    assert tracker.breaks.event_waited(ready, FakeStream(4))
    assert log["records"] == [(ready, main)]


def test_a_break_waiting_on_a_stream_that_took_part_in_a_segment_follows_the_replay_stream():
    tracker, main, side, _ready, log = tracker_between_segments()
    comm, untouched = FakeStream(6), FakeStream(7)
    tracker.breaks.stream_waited(comm, side)  # side's segment work ran in the graph
    tracker.breaks.stream_waited(comm, untouched)  # eager work only: torch's own wait orders it
    tracker.breaks.stream_waited(main, side)  # the replay stream orders itself
    assert end_break(tracker)._followers.keys() == {6} and log["forks"] == [comm]


def test_a_break_that_raised_leaves_no_event_a_later_graph_would_wait_on():
    """Its segment is not recorded, so nothing would record its events at replay: a later
    wait on one is left to CUDA, which refuses it."""
    tracker, main, side, _ready, _log = tracker_between_segments()
    done = FakeEvent()
    tracker.breaks.event_recorded(done, side)
    tracker.break_discarded()
    tracker.segment_begun()
    assert not tracker.waited_in_segment(done, main)


def test_a_wait_on_a_break_event_of_another_device_is_refused_with_the_fix():
    tracker, main, side, _ready, _log = tracker_between_segments()
    elsewhere = FakeStream(8)
    elsewhere.device_index = 1
    done = FakeEvent()
    tracker.breaks.event_recorded(done, elsewhere)
    end_break(tracker)
    tracker.segment_begun()
    with pytest.raises(StreamJoinError, match=r"cuda:1, while the capture runs on cuda:0.*wait_stream"):
        tracker.waited_in_segment(done, main)


def test_a_segment_waiting_on_a_stream_a_break_used_waits_on_the_latest_breaks_signal():
    """A segment's wait on a stream outside the capture that a break queued work on becomes an
    event-wait node on an event the latest recorded break's replay records on that stream,
    made when first needed; a break that raised is not the one."""
    tracker, main, _side, _ready, log = tracker_between_segments()
    comm, forked, outside = FakeStream(6), FakeStream(7), FakeStream(8)
    tracker.breaks.stream_waited(comm, main)  # comm.wait_stream(current) before queuing work on it
    first = RecordedBreak()
    tracker.break_ended(first)
    assert first.ordering is None  # no event crossed it
    tracker.segment_begun()
    tracker.segment_ending()
    tracker.break_begun()
    tracker.break_discarded()  # the caller went on past a break that raised
    tracker.segment_begun()
    sim = log["sim"]
    sim.start()
    sim.wait_stream(forked, main)
    tracker.stream_waited(forked, main)
    assert tracker.waited_on_uncaptured_stream(main, comm) and tracker.waited_on_uncaptured_stream(forked, comm)
    signal = first.ordering.signal_on(comm.cuda_stream)
    assert log["waits"] == [(main, signal), (forked, signal)] and first.ordering.has_signals
    assert not tracker.waited_on_uncaptured_stream(outside, comm)  # neither in the capture: CUDA's wait
    assert not tracker.waited_on_uncaptured_stream(main, forked)  # in the capture: a join
    assert not tracker.waited_on_uncaptured_stream(forked, main)  # a fork


def test_a_stream_a_break_used_waits_for_that_work_when_a_later_segment_forks_it():
    """Forked again in a later segment, or carried across the break, a stream the break queued
    work on first waits on the latest break's signal on it; once: later segments follow that
    graph, until a break queues work on the stream again."""
    tracker, main, side, _ready, log = tracker_between_segments()
    comm, joined = FakeStream(6), FakeStream(7)
    sim = log["sim"]

    def segment_then_break(*touched):
        tracker.segment_begun()  # forks the carried side stream again
        sim.start()
        for _ in range(2):  # a fork, a join, a fork again
            for stream in (comm, joined):
                sim.wait_stream(stream, main)
                tracker.stream_waited(stream, main)
                tracker.stream_waited(main, stream)
        tracker.segment_ending()
        tracker.break_begun()
        for stream in touched:
            tracker.breaks.stream_waited(stream, main)
        recorded = RecordedBreak()
        tracker.break_ended(recorded)
        return recorded

    tracker.breaks.stream_waited(comm, main)
    tracker.breaks.stream_waited(side, main)  # side is carried across the break, too
    first = RecordedBreak()
    tracker.break_ended(first)
    second = segment_then_break()  # its graph waits for the first break's work on side and comm
    signals = first.ordering._signals
    assert log["waits"] == [(side, signals[side.cuda_stream][1]), (comm, signals[comm.cuda_stream][1])]
    segment_then_break(comm)  # waits for nothing more: the last graph did
    assert len(log["waits"]) == 2 and second.ordering is None
    tracker.segment_begun()  # the last break queued work on comm again
    sim.start()
    sim.wait_stream(comm, main)
    tracker.stream_waited(comm, main)
    assert len(log["waits"]) == 3 and log["waits"][-1][0] is comm
    assert tracker.waited_on_uncaptured_stream(main, joined)  # its work is in earlier graphs: replay orders it
    assert len(log["waits"]) == 3


def test_a_wait_on_an_uncaptured_stream_that_no_break_can_order_is_refused_with_the_fix():
    main, comm = FakeStream(1), FakeStream(2)
    sim = SimulatedCapture(main)
    tracker = ForkJoinTracker(main, sim.info, join=lambda c, s: None, fork=lambda s, c: None, wait_external=lambda s, e: None)
    tracker.segment_begun()
    fix = r"no break queued work that breakgraph saw.*Fork a side stream into the capture.*@eager_on_graph"
    with pytest.raises(StreamJoinError, match=fix):
        tracker.waited_on_uncaptured_stream(main, comm)  # before any break
    tracker.segment_ending()
    tracker.break_begun()
    elsewhere = FakeStream(3)
    elsewhere.device_index = 1
    tracker.breaks.stream_waited(elsewhere, main)
    end_break(tracker)
    tracker.segment_begun()
    sim.start()
    with pytest.raises(StreamJoinError, match=fix):
        tracker.waited_on_uncaptured_stream(main, comm)  # no break used it
    with pytest.raises(StreamJoinError, match=r"cuda:1, on which a break queued work, while the capture runs on cuda:0.*wait_stream"):
        tracker.waited_on_uncaptured_stream(main, elsewhere)


def test_a_conditional_body_waiting_on_a_stream_outside_the_capture_is_refused_before_cuda_is_asked():
    """A body stream captures on its own (another capture id): CUDA would refuse the wait
    there and fail the body's capture, so the tracker says what to do first."""
    main, body, comm = FakeStream(1), FakeStream(2), FakeStream(3)
    ids = {main: 1, body: 2}

    def info(stream):
        return CaptureInfo(CaptureStatus.ACTIVE, ids[stream]) if stream in ids else CaptureInfo(CaptureStatus.NONE)

    tracker = ForkJoinTracker(main, info, join=lambda c, s: None, fork=lambda s, c: None, wait_external=lambda s, e: None)
    tracker.segment_begun()
    with pytest.raises(StreamJoinError, match=r"capturing a conditional body.*before the breakgraph.cond or while_loop"):
        tracker.waited_on_uncaptured_stream(body, comm)


def test_a_break_that_waits_on_the_host_for_a_segments_event_waits_for_the_graphs_before_every_replay():
    """``synchronize()`` or ``query()`` in a break on an event a segment recorded: the event is
    recorded again on the capture stream at once (once per segment that recorded it), and the
    host waits for the replay stream's work before every replay of the break; the break's own
    events need neither."""
    tracker, main, side, ready, log = tracker_between_segments()
    tracker.breaks.event_synchronized(ready)
    tracker.breaks.event_synchronized(ready)
    done = FakeEvent()
    tracker.breaks.event_recorded(done, side)
    tracker.breaks.event_synchronized(done)
    ordering = end_break(tracker)
    assert log["records"] == [(ready, main)]
    assert ordering.runs_before and ordering._host_waits and not ordering._followers
    tracker.segment_begun()
    tracker.breaks.event_synchronized(ready)  # in a segment: CUDA's to refuse
    assert log["records"] == [(ready, main)]
    log["sim"].start()
    tracker.event_recorded(ready, main)  # the model records the same event in a later segment
    tracker.segment_ending()
    tracker.break_begun()
    assert tracker.breaks.event_waited(ready, side)
    assert log["records"] == [(ready, main), (ready, main)]  # its new record is a capture's again


def test_before_a_break_the_host_waits_for_the_replay_streams_work_where_the_break_did():
    calls = []

    class Ready:
        def record(self, stream):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append(("synchronize",))

    ordering = break_ordering.BreakOrdering()
    ordering.wait_on_host()
    ordering._ready = Ready()
    ordering.before(0x77)
    assert calls == [("record", 0x77), ("synchronize",)]


def test_a_break_returning_a_result_writes_it_back_after_its_side_streams_work_joined_or_not():
    """Forked in the break, joined by ``wait_stream``, by the capture stream's wait on an event
    the break recorded there, or by the host's ``synchronize()`` on one: the writeback waits
    for each, as the break may queue more work there after the join, which the hooks do not
    see. Another device's stream is not waited for (the events live on the capture's); a break
    that writes nothing back, or that raised, waits for nothing."""
    tracker, main, side, _ready, _log = tracker_between_segments()
    comm, by_stream, by_event, by_host = (FakeStream(handle) for handle in (6, 7, 8, 9))
    elsewhere = FakeStream(10)
    elsewhere.device_index = 1
    for stream in (comm, by_stream, by_event, by_host, elsewhere):
        tracker.breaks.stream_waited(stream, main)  # forked: stream.wait_stream(current)
    tracker.breaks.stream_waited(main, by_stream)
    done, finished = FakeEvent(), FakeEvent()
    tracker.breaks.event_recorded(done, by_event)
    tracker.breaks.event_waited(done, main)
    tracker.breaks.event_recorded(finished, by_host)
    tracker.breaks.event_synchronized(finished)
    ordering = end_break(tracker, writes_back=True)
    assert ordering.orders_writeback and ordering._writeback_waits.keys() == {6, 7, 8, 9}

    def next_break(*forked, raises=False, writes_back=True):
        tracker.segment_begun()
        tracker.segment_ending()
        tracker.break_begun()
        for stream in forked:
            tracker.breaks.stream_waited(stream, main)
        if raises:
            tracker.break_discarded()
            return None
        return end_break(tracker, writes_back)

    assert next_break(comm, writes_back=False) is None  # its result (None) has no writeback
    next_break(comm, raises=True)
    assert next_break() is None  # nothing of the break that raised is left over
    assert next_break(elsewhere) is None


def test_the_writeback_waits_for_the_side_streams_which_then_wait_for_it(monkeypatch):
    calls = []

    class Event:
        def __init__(self, name):
            self.name = name

        def record(self, stream):
            calls.append((f"record {self.name}", int(stream)))

    names = iter(["done", "written"])
    monkeypatch.setattr(break_ordering.bindings, "Event", lambda: Event(next(names)))
    monkeypatch.setattr(break_ordering.bindings, "wait_event", lambda stream, event: calls.append((f"wait {event.name}", int(stream))))
    ordering = break_ordering.BreakOrdering()
    ordering.write_back_after(0x6)
    ordering.write_back_after(0x6)  # once per stream
    ordering.before_writeback(0x77)
    ordering.after_writeback(0x77)
    assert calls == [("record done", 0x6), ("wait done", 0x77), ("record written", 0x77), ("wait written", 0x6)]


@pytest.mark.parametrize(
    "refusal",
    [
        CudaError(904, "cudaStreamEndCapture"),  # the bindings' end of a segment
        RuntimeError("CUDA error: capturing stream has unjoined work"),  # torch's, for a segment torch records
    ],
)
def test_a_fork_breakgraph_did_not_see_is_named_at_the_break_where_its_segment_could_not_end(refusal):
    error = unseen_fork(refusal, "reduce()")
    assert isinstance(error, StreamJoinError)
    assert str(error).startswith("the segment before reduce() cannot end: a stream forked into it")
    assert "work.wait()" in str(error) and "torch.cuda.current_stream().wait_stream(side)" in str(error)
    assert str(unseen_fork(refusal, "end")).startswith("the segment before the capture's end cannot end")
    assert str(unseen_fork(refusal, "aten.rand_like.default")).startswith(
        "the segment before the random op aten.rand_like.default (a segment ends at its first random op"
    )
    assert clearer_error(error, "graph") is None  # what it says is not rewritten as an op the capture refused


def test_other_segment_end_failures_are_left_as_they_are():
    assert unseen_fork(CudaError(901, "cudaStreamEndCapture"), "f()") is None  # invalidated
    assert unseen_fork(ValueError("capturing stream has unjoined work"), "f()") is None
