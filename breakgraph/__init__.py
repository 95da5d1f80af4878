"""breakgraph: breakable CUDA graphs for PyTorch.

One capture region becomes a sequence of CUDA graph segments split by eager
breaks, so the few parts of a model that cannot be captured run eagerly
while the rest keeps the launch-overhead savings of graphs.
"""

__version__ = "0.1.0"

from breakgraph_bindings import CudaError
from breakgraph.breaks import LifetimeWarning
from breakgraph.capture import BreakableCUDAGraphCapture
from breakgraph.context import is_capturing
from breakgraph.debug import SegmentError
from breakgraph.dispatch import CaptureInvalidatedError, UncapturableOpError
from breakgraph.eager import break_graph, eager_on_graph
from breakgraph.graph import BreakableCUDAGraph
from breakgraph.graphed import GraphedCallable, graphed
from breakgraph.options import CaptureOptions, RunnerOptions
from breakgraph.outputs import FrozenOutputWarning
from breakgraph.pool import pool_bytes
from breakgraph.ranks import CaptureAgreement, PeerCaptureError, agreed_batch_size
from breakgraph.runner import GraphRunner
from breakgraph.sharing import share_executables
from breakgraph.sizes import default_capture_sizes
from breakgraph.streams import StreamJoinError
from breakgraph.tables import format_table
from breakgraph.writeback import WritebackError

__all__ = [
    "BreakableCUDAGraph",
    "BreakableCUDAGraphCapture",
    "CaptureAgreement",
    "CaptureInvalidatedError",
    "CaptureOptions",
    "CudaError",
    "FrozenOutputWarning",
    "GraphRunner",
    "GraphedCallable",
    "LifetimeWarning",
    "PeerCaptureError",
    "RunnerOptions",
    "SegmentError",
    "StreamJoinError",
    "UncapturableOpError",
    "WritebackError",
    "agreed_batch_size",
    "break_graph",
    "default_capture_sizes",
    "eager_on_graph",
    "format_table",
    "graphed",
    "is_capturing",
    "pool_bytes",
    "share_executables",
]
