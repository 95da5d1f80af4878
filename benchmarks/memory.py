"""Pool bytes of the decoder captured at batch sizes 1 … 64 into one shared pool.

Variants, side by side in one run: breakgraph (a GraphRunner, attention as
the eager break); monolithic torch.cuda.graph per size (attention's length
frozen at capture); one torch.cuda.CUDAGraph per segment per size (the
peers' way); one BreakableCUDAGraph per size in Meta's library
(breakable_cuda_graphs, the ``bench`` extra; skipped with the reason printed
where it is not installed), whose attention breaks write into output
buffers allocated in the pool. Each captures largest size first into its
own shared torch.cuda.MemPool, and every size of every variant is checked
against eager before the pool is measured.

    python -m benchmarks.memory [--quick] [--out results] [--layers 16]
"""

from __future__ import annotations

import functools

import torch

import breakgraph as bg

from benchmarks.common import benchmark_parser, device_meta, plot_lines, require_gpu, write_outputs
from benchmarks.decoder import Decoder, DecoderConfig, MetaBreakable
from benchmarks.decoder_sizes import (
    BatchInputs,
    capture_breakgraph_sizes,
    capture_monolithic_sizes,
    capture_piecewise_sizes,
    check_sizes,
    graphs_replay,
    runner_replay,
)
from benchmarks.peers import META, load_meta, meta_ratios

LENGTH = 1015


def main(argv=None) -> int:
    parser = benchmark_parser("memory", __doc__)
    parser.add_argument("--quick", action="store_true", help="small smoke run: 2 layers, sizes 1, 2, 4, 8")
    parser.add_argument("--layers", type=int, default=None)
    args = parser.parse_args(argv)
    require_gpu("memory")
    config = DecoderConfig(layers=args.layers or (2 if args.quick else 16))
    all_sizes = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64]

    decoder = Decoder(config, max_batch=max(all_sizes))
    inputs = BatchInputs(decoder, max(all_sizes), LENGTH)
    stream = torch.cuda.Stream()
    inputs.warm_up(all_sizes, stream)
    meta_library = load_meta()
    rows = []
    for count in range(1, len(all_sizes) + 1):
        sizes = all_sizes[:count]
        measured = pools_at(inputs, sizes, stream, meta_library)
        for name, (nbytes, worst) in measured.items():
            rows.append(
                {
                    "sizes": f"1..{sizes[-1]}",
                    "largest": sizes[-1],
                    "variant": name,
                    "pool_mib": round(nbytes / 2**20, 2),
                    "max_abs_diff_vs_eager": round(worst, 4),
                }
            )
        ours, monolithic = measured["breakgraph"][0], measured["monolithic torch.cuda.graph per size"][0]
        ratios = f"breakgraph/monolithic {ours / monolithic:.3f}x"
        ratios += meta_ratios({name: pool for name, (pool, _worst) in measured.items()}, {"breakgraph": ours}, digits=3)
        rows.append({"sizes": f"1..{sizes[-1]}", "largest": sizes[-1], "variant": "ratios", "pool_mib": ratios})
    meta = device_meta() | {"config": {k: str(v) for k, v in vars(config).items()}, "kv_length": LENGTH}
    write_outputs("memory", rows, ["sizes", "variant", "pool_mib", "max_abs_diff_vs_eager"], args.out, meta, draw)
    return 0


def pools_at(inputs: BatchInputs, sizes: list[int], stream: torch.cuda.Stream, meta_library) -> dict:
    """{variant: (pool bytes, largest difference from eager)} of every way captured at ``sizes``,
    each way's graphs and pool let go before the next's."""
    measured = {}

    runner = capture_breakgraph_sizes(inputs, sizes)
    worst = check_sizes(inputs, runner_replay(inputs, runner), sizes)
    measured["breakgraph"] = (bg.pool_bytes(runner.pool), worst)
    del runner

    pool = torch.cuda.MemPool()
    graphs = capture_monolithic_sizes(inputs, sizes, pool.id, stream)
    worst = check_sizes(inputs, graphs_replay(graphs), sizes)
    measured["monolithic torch.cuda.graph per size"] = (bg.pool_bytes(pool), worst)
    del graphs, pool

    pool = torch.cuda.MemPool()
    graphs = capture_piecewise_sizes(inputs, sizes, pool.id, stream)
    worst = check_sizes(inputs, graphs_replay(graphs), sizes)
    measured["torch CUDAGraph per segment, per size"] = (bg.pool_bytes(pool), worst)
    del graphs, pool

    if meta_library is not None:
        pool = torch.cuda.MemPool()
        meta_way = functools.partial(MetaBreakable, meta_library)
        graphs = capture_piecewise_sizes(inputs, sizes, pool.id, stream, way=meta_way)
        worst = check_sizes(inputs, graphs_replay(graphs), sizes)
        measured[META] = (bg.pool_bytes(pool), worst)
        del graphs, pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return measured


def draw(ax, rows):
    plot_lines(ax, rows, "largest", "pool_mib")
    ax.set_xlabel("largest batch size captured (all powers of two up to it, one pool)")
    ax.set_ylabel("pool MiB (lower is better)")
    ax.set_title(f"Memory pool of the captured decoder ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    raise SystemExit(main())
