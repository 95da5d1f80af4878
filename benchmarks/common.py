"""Shared pieces of the benchmarks: timing, output files, the table."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from breakgraph.debug import format_table


def time_per_call_us(fn, iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the wall time per call of ``fn`` (host issue + GPU drain), in µs."""
    results = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        results.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(results)


def write_outputs(name: str, rows: list[dict], columns: list[str], out_dir: str | Path, meta: dict) -> Path:
    """Print the table, write ``<name>.json``; return the output folder."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(format_table(rows, columns))
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return out_dir


def device_meta() -> dict:
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
