"""Which capture is active in this context, and the full-graph warm-up switch breaks read."""

import threading

import pytest

import breakgraph as bg
from breakgraph.base import context


class FakeCapture:
    segment_open = False


def test_is_capturing_follows_activate_and_deactivate_per_thread():
    assert not bg.is_capturing()
    token = context.activate(FakeCapture())
    try:
        assert bg.is_capturing()
        seen = []
        thread = threading.Thread(target=lambda: seen.append(bg.is_capturing()))
        thread.start()
        thread.join()
        assert seen == [False]  # another thread's capture is not this one's
    finally:
        context.deactivate(token)
    assert not bg.is_capturing() and context.current() is None


def test_full_graph_warmup_is_scoped_and_reset_after_an_error():
    assert not context.warming_up_full_graph()
    with pytest.raises(KeyError):
        with context.full_graph_warmup():
            assert context.warming_up_full_graph()
            with context.full_graph_warmup():
                assert context.warming_up_full_graph()
            assert context.warming_up_full_graph()
            raise KeyError("inside")
    assert not context.warming_up_full_graph()


def test_a_break_runs_its_capturable_variant_during_a_full_graph_warmup_only():
    @bg.eager_on_graph
    def attention(x):
        return ("eager", x)

    @attention.inline
    def attention_in_graph(x):
        return ("inline", x)

    assert attention(1) == ("eager", 1)
    with context.full_graph_warmup():
        assert attention(2) == ("inline", 2)
    assert attention(3) == ("eager", 3)
