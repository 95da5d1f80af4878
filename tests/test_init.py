"""The package's public names."""

import breakgraph as bg


def test_public_names():
    for name in [
        "BreakableCUDAGraph",
        "BreakableCUDAGraphCapture",
        "GraphRunner",
        "break_graph",
        "eager_on_graph",
        "graphed",
        "is_capturing",
    ]:
        assert hasattr(bg, name)
    assert set(bg.__all__) <= set(dir(bg))
