"""breakgraph's recording layer: what happens while a region is captured.

The recorder cuts the region into segments at its breaks; a break is recorded
with its aliased arguments and its writer; the op watch, the ``wait_stream``
fork/join tracker, segments that draw random numbers and the output rule check
what the region does. It builds on :mod:`breakgraph.base` only.
"""
