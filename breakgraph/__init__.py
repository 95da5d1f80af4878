"""breakgraph: breakable CUDA graphs for PyTorch.

One capture region becomes a sequence of CUDA graph segments split by eager
breaks, so the few parts of a model that cannot be captured run eagerly
while the rest keeps the launch-overhead savings of graphs.
"""

__version__ = "0.1.0"

from breakgraph_bindings import CudaError
from breakgraph.recording.breaks import LifetimeWarning
from breakgraph.graphs.capture import BreakableCUDAGraphCapture
from breakgraph.base.context import is_capturing
from breakgraph.graphs.debug import SegmentError
from breakgraph.recording.dispatch import CaptureInvalidatedError, UncapturableOpError
from breakgraph.recording.conditional import cond, while_loop
from breakgraph.recording.eager import break_graph, eager_on_graph
from breakgraph.graphs.graph import BreakableCUDAGraph
from breakgraph.graphs.graphed import GraphedCallable, graphed
from breakgraph.base.options import CaptureOptions, RunnerOptions
from breakgraph.recording.outputs import FrozenOutputWarning
from breakgraph.base.pool import pool_bytes
from breakgraph.base.ranks import CaptureAgreement, PeerCaptureError, agreed_batch_size
from breakgraph.serving.runner import GraphRunner
from breakgraph.graphs.sharing import share_executables
from breakgraph.base.sizes import default_capture_sizes
from breakgraph.recording.streams import StreamJoinError
from breakgraph.base.tables import format_table
from breakgraph.recording.writeback import WritebackError

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
    "cond",
    "default_capture_sizes",
    "eager_on_graph",
    "format_table",
    "graphed",
    "is_capturing",
    "pool_bytes",
    "share_executables",
    "while_loop",
]
