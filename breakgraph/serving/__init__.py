"""breakgraph's serving layer: graphs per batch size for an engine.

:class:`GraphRunner`, its static inputs and padding, how it captures each size
(warm-up, retries, lazily, the eager fallback), its memory, and the ranks it
agrees with. It builds on the graph layer.
"""
