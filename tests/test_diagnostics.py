"""Diagnostics that need no GPU: the profile table, and what each function refuses."""

import warnings

import pytest
import torch

import breakgraph as bg
from breakgraph import diagnostics
from breakgraph.diagnostics import format_profile
from breakgraph.base.runtime import cuda_available


def test_profile_table_has_timing_columns():
    rows = [{"index": 0, "kind": "graph", "name": "g", "mean_us": 1.5, "p50_us": 1.4, "p99_us": 2.0, "share": 1.0}]
    header = format_profile(rows).splitlines()[0].split()
    assert header == ["index", "kind", "name", "mean_us", "p50_us", "p99_us", "share"]


@pytest.mark.parametrize("function", [diagnostics.summary, diagnostics.profile, lambda g: diagnostics.to_dot(g, "unused")])
def test_diagnostics_of_something_that_is_not_a_graph_say_what_they_need(function):
    with pytest.raises(TypeError, match=r"needs a BreakableCUDAGraph or a graphed callable \(bg.graphed\(...\)\), got int"):
        function(42)
    with pytest.raises(RuntimeError, match="needs a captured graph: capture it first"):
        function(bg.BreakableCUDAGraph())


def test_profile_refuses_no_timed_replays_and_a_failed_size_is_named_by_its_key(capsys):
    with pytest.raises(ValueError, match="iters must be a whole number >= 1, got 0"):
        diagnostics.profile(bg.BreakableCUDAGraph(), iters=0)
    report = {"eager_reason": None, "rows": [], "pool_bytes": 0, "executable_bytes": None,
              "failed": [{"key": 0, "size": 8, "reason": "OOM"}, {"key": "", "size": 4, "reason": "OOM"}]}
    diagnostics.print_runner_report(report, shared=False)
    printed = capsys.readouterr().out
    assert "size 8 (key 0) is served eagerly" in printed and "size 4 is served eagerly" in printed


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU fallback")
def test_diagnostics_of_a_callable_that_runs_eagerly_say_so():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = bg.graphed(lambda x: x + 1, torch.ones(2))
    with pytest.raises(TypeError, match="this callable runs eagerly"):
        diagnostics.summary(step)
