"""breakgraph's bottom layer: the services every other layer uses, and that import no other layer.

Options and their checks, the active capture's context, the GPU runtime and
capture streams, memory pools, pytree walking, tables, batch sizes, ranks that
agree, the memory estimate's arithmetic. See docs/design.md#layers.
"""
