"""@eager_on_graph and break_graph() outside a capture: plain calls."""

import breakgraph as bg


def test_decorator_passes_through_outside_capture():
    calls = []

    @bg.eager_on_graph
    def f(x, *, k=1):
        """doc"""
        calls.append((x, k))
        return x + k

    assert f(1, k=2) == 3 and calls == [(1, 2)]
    assert f.__name__ == "f" and f.__doc__ == "doc"


def test_decorator_enable_forms():
    def g(x):
        return x

    assert bg.eager_on_graph(enable=False)(g) is g
    wrapped = bg.eager_on_graph(enable=True)(g)
    assert wrapped is not g and wrapped(4) == 4


def test_bound_method_passthrough():
    class Layer:
        scale = 3

        @bg.eager_on_graph
        def run(self, x):
            return x * self.scale

    assert Layer().run(2) == 6


def test_break_graph_and_is_capturing_outside_capture():
    bg.break_graph()
    assert bg.is_capturing() is False
