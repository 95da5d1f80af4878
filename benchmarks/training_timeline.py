"""The training step's timelines, variant by variant, from torch's profiler.

Where ``benchmarks.training_step`` says how long each variant's step takes,
this says why: every variant of that benchmark (the same trainer, captures
and check against eager) runs profiled steps, and each step's trace is
reduced to what the host called (graph launches, kernel launches, copies,
synchronizations, and the time spent in those calls), how long the GPU
worked and stood idle, the longest idle gap and what the host called right
before the GPU started again, how far into the step each host read of a GPU
value (``.item()`` and the like) sits, and how many blocks the caching
allocator handed out per step (counted apart, unprofiled). The profiler
slows the host, so compare the variants with each other, not with the
timings of ``training_step``. Writes the table, JSON, a plot of one step of
each graph variant side by side at the first shape, and one Chrome trace per variant and shape
(open in https://ui.perfetto.dev).

    python3 -m benchmarks.training_timeline [--quick] [--out results] [--steps 20] [--shapes small|all]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, device_meta, require_gpu, write_outputs
from benchmarks.peers import load_meta
from benchmarks.training_step import Captured, Trainer

SHAPES = {"small": [(512, 8, 32)], "all": [(512, 8, 32), (1024, 8, 256), (2048, 8, 1024)]}
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_READS = ("aten::_local_scalar_dense",)  # under .item() and bool(tensor) alike
STEP = "training step"


def call_kind(name: str) -> str:
    """What a CUDA runtime or driver call does, in the table's words."""
    if "GraphLaunch" in name:
        return "graph launches"
    if "LaunchKernel" in name or name.startswith("cuLaunch"):
        return "kernel launches"
    if "Memcpy" in name or "Memset" in name:
        return "copies"
    if "Synchronize" in name or "EventQuery" in name:
        return "syncs"
    return "other calls"


KINDS = ("graph launches", "kernel launches", "copies", "syncs", "other calls")


def profile_steps(run, steps: int, trace_path: Path) -> list[dict]:
    """Profile ``steps`` calls of ``run`` (each followed by a device synchronization) and
    return the events of the Chrome trace the profiler writes to ``trace_path``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(3):  # warm: the first profiled calls pay for the profiler's own set-up
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            with record_function(STEP):
                run()
                torch.cuda.synchronize()
    profiler.export_chrome_trace(str(trace_path))
    return [event for event in json.loads(trace_path.read_text())["traceEvents"] if event.get("ph") == "X"]


def step_timeline(events: list[dict], window: dict) -> dict:
    """One step's figures: what the host called inside ``window`` (the step's annotation) and
    what the GPU ran between the window's start and its end."""
    start, end = window["ts"], window["ts"] + window["dur"]
    inside = [e for e in events if start <= e["ts"] < end]
    calls = sorted((e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])
    work = sorted((e for e in inside if e.get("cat") in GPU_WORK), key=lambda e: e["ts"])
    figures = {kind: 0 for kind in KINDS}
    for call in calls:
        figures[call_kind(call["name"])] += 1
    busy, gaps, reach = 0.0, [], start
    for item in work:  # the union of the GPU's work intervals, and the gaps between them
        item_start, item_end = item["ts"], min(item["ts"] + item["dur"], end)
        if item_start > reach:
            gaps.append((item_start - reach, item_start))
        busy += max(0.0, item_end - max(item_start, reach))
        reach = max(reach, item_end)
    longest, resumed_at = max(gaps, default=(0.0, start))
    before = [c for c in calls if c["ts"] <= resumed_at]
    figures.update(
        step_us=window["dur"],
        host_in_calls_us=sum(c["dur"] for c in calls),
        gpu_busy_us=busy,
        gpu_idle_us=window["dur"] - busy,
        longest_gap_us=longest,
        gap_ended_by=before[-1]["name"] if before else "",
        host_reads_at_us=[round(e["ts"] - start, 1) for e in inside if e.get("cat") == "cpu_op" and e["name"] in HOST_READS],
        lanes={
            "host": [(c["ts"] - start, c["dur"], call_kind(c["name"])) for c in calls],
            "gpu": [(w["ts"] - start, w["dur"], "gpu work") for w in work],
        },
    )
    return figures


def allocations_per_step(run, steps: int) -> float:
    """Blocks the caching allocator handed out per call of ``run``, unprofiled."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    return (torch.cuda.memory_stats()["allocation.all.allocated"] - before) / steps


def summarize(steps: list[dict]) -> dict:
    """The median of each figure over the profiled steps, and the median step's lanes."""
    middle = sorted(steps, key=lambda s: s["step_us"])[len(steps) // 2]
    keys = ("step_us", "host_in_calls_us", "gpu_busy_us", "gpu_idle_us", "longest_gap_us", *KINDS)
    numbers = {key: statistics.median(s[key] for s in steps) for key in keys}
    return {**numbers, "gap_ended_by": middle["gap_ended_by"], "host_reads_at_us": middle["host_reads_at_us"], "lanes": middle["lanes"]}


def main(argv=None) -> int:
    parser = benchmark_parser("training_timeline", __doc__)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps per variant")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="small")
    args = parser.parse_args(argv)
    require_gpu("training_timeline")
    shapes = [(512, 4, 32)] if args.quick else SHAPES[args.shapes]
    steps = 5 if args.quick else args.steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stream, meta_library = torch.cuda.Stream(), load_meta()
    rows, lanes = [], {}
    for hidden, layers, batch in shapes:
        captured = Captured(Trainer(hidden, layers, batch, dropout=0.1), stream, meta_library)
        captured.check()
        label = f"{hidden}x{layers}, batch {batch}"
        for name, run in captured.runs().items():
            trace = out / f"training_timeline {label} {name}.json".replace(" ", "_").replace(",", "").replace(":", "")
            events = profile_steps(run, steps, trace)
            windows = [e for e in events if e["name"] == STEP and e.get("cat") == "user_annotation"]
            summary = summarize([step_timeline(events, window) for window in windows])
            lane = summary.pop("lanes")
            if (hidden, layers, batch) == shapes[0] and name != "eager":  # the host-bound shape; eager is 6x as long
                lanes[name] = lane
            rows.append(
                {
                    "shape": label,
                    "variant": name,
                    **{key: round(value, 1) if isinstance(value, float) else value for key, value in summary.items()},
                    "allocations": allocations_per_step(run, steps),
                }
            )
        del captured
    columns = ["shape", "variant", "step_us", "gpu_busy_us", "gpu_idle_us", "longest_gap_us", "gap_ended_by", *KINDS]
    columns += ["host_in_calls_us", "host_reads_at_us", "allocations"]
    write_outputs("training_timeline", rows, columns, out, device_meta(), lambda ax, _rows: draw(ax, lanes))
    return 0


COLORS = {"graph launches": "tab:blue", "kernel launches": "tab:orange", "copies": "tab:green", "syncs": "tab:red"}
COLORS.update({"other calls": "tab:gray", "gpu work": "black"})


def draw(ax, lanes: dict) -> None:
    """One profiled step of each graph variant at the first shape: its host calls above its GPU
    work, on one time axis."""
    ticks, labelled = [], set()
    for row, (name, lane) in enumerate(lanes.items()):
        for offset, (which, height) in enumerate((("host", 0.35), ("gpu", 0.2))):
            y = -(row * 1.0 + offset * 0.4)
            for kind in dict.fromkeys(kind for _, _, kind in lane[which]):
                bars = [(start, max(duration, 0.5)) for start, duration, k in lane[which] if k == kind]
                ax.broken_barh(bars, (y - height / 2, height), color=COLORS[kind], label=None if kind in labelled else kind)
                labelled.add(kind)
            ticks.append((y, f"{name} · {which}"))
    ax.set_yticks([y for y, _ in ticks], [label for _, label in ticks], fontsize=6)
    ax.set_xlabel("µs from the step's start (profiled: slower than unprofiled)")
    ax.set_title(f"One training step per graph variant, smallest shape ({torch.cuda.get_device_name()})", fontsize=9)


if __name__ == "__main__":
    raise SystemExit(main())
