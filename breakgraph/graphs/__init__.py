"""breakgraph's graph layer: a captured region as a graph that replays.

:class:`BreakableCUDAGraph` and its replay plan, debug mode's checked replay,
executables shared across graphs of one topology, and the two ways to capture
one: the ``with`` block and ``graphed``. It builds on the recording layer.
"""
