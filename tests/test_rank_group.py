"""A runner's ranks (group=), on CPU processes over gloo: what they agree on, and a lost peer.

Without a GPU a runner runs its function eagerly, so these check the parts
that need no graph: every call padded to the largest batch of any rank, the
same key on every rank, one agreement for a call's shape, a broadcast, the
barrier before a break's collectives, and a peer whose process is gone.
"""

import json
import os
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import breakgraph as bg
from breakgraph.recording.dispatch import BarrierBeforeCollectives
from breakgraph.serving.batches import StaticInputs
from breakgraph.serving.policy import CapturePolicy
from breakgraph.serving.rank_group import GIVE_UP, KEEP, RETRY, RankGroup

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")

WORLD = 3


def _join(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))


def _summed_rows(x: torch.Tensor) -> torch.Tensor:
    """A row-wise step whose collective needs every rank's batch to have the same rows."""
    y = x * 2
    dist.all_reduce(y)
    return y


def _agreeing_ranks(rank: int, store: str, results: str) -> None:
    _join(rank, store)
    outcome = {}
    ranks = RankGroup(None, timeout=30)
    outcome["dispatch"] = ranks.dispatch([3, 7, 1][rank], [1, 0])
    try:
        ranks.dispatch(2, [rank % 2, -1])
    except ValueError as error:
        outcome["keys"] = str(error)
    try:  # the same first key, but not the same fallback: the walk could part at the second
        ranks.dispatch(2, [1, 0] if rank else [1, -1])
    except ValueError as error:
        outcome["fallback"] = str(error)
    ranks.same([4, 5], "the call")
    try:
        ranks.same([4, rank], "the call")
    except ValueError as error:
        outcome["same"] = str(error)
    outcome["retry"] = [ranks.retry_together(report) for report in ([KEEP, RETRY, KEEP][rank], [RETRY, GIVE_UP, KEEP][rank], KEEP)]
    outcome["broadcast"] = ranks.broadcast(torch.tensor([rank, 10 + rank])).tolist()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no GPU: the runner runs eagerly, and says so
        runner = bg.GraphRunner(_summed_rows, torch.zeros(8, 2), [2, 4, 8], group=dist.group.WORLD, progress=False)
    rows = [1, 6, 11][rank]  # above the largest size on rank 2: every rank pads to 11 rows
    x = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) + rank
    y = runner(x)
    outcome["runner_rows"] = list(y.shape)
    padded = torch.zeros(11, 2)
    padded[:rows] = x
    expected = _summed_rows(padded)[:rows]
    outcome["runner_matches"] = torch.equal(y, expected)

    barriers = []
    with BarrierBeforeCollectives(lambda: barriers.append("barrier")):
        z = torch.ones(2)
        dist.all_reduce(z)
        barriers.append("all_reduce")
        waited = dist._functional_collectives.all_reduce(z, "sum", dist.group.WORLD) + 1  # issue, then wait
        barriers.append("functional")
    outcome["barriers"] = barriers
    outcome["functional"] = waited.tolist()
    with open(os.path.join(results, f"{rank}.json"), "w") as out:
        json.dump(outcome, out)
    dist.destroy_process_group()


def _run(tmp_path, target, world=WORLD) -> list[dict]:
    store, results = tmp_path / "store", tmp_path / "results"
    results.mkdir()
    mp.spawn(target, args=(str(store), str(results)), nprocs=world, join=True)
    return [json.loads((results / f"{rank}.json").read_text()) for rank in range(world)]


def test_ranks_agree_on_batch_key_call_retry_and_state(tmp_path):
    for rank, outcome in enumerate(_run(tmp_path, _agreeing_ranks)):
        assert outcome["dispatch"] == 7
        assert "chose different keys" in outcome["keys"] and "chose different keys" in outcome["fallback"]
        assert "disagree on the call" in outcome["same"]
        assert outcome["retry"] == [True, False, False], rank
        assert outcome["broadcast"] == [0, 10]
        assert outcome["runner_rows"] == [[1, 6, 11][rank], 2]
        assert outcome["runner_matches"], rank
        assert outcome["barriers"] == ["barrier", "all_reduce", "barrier", "functional"]
        assert outcome["functional"] == [WORLD * WORLD + 1] * 2


def _capturing_each(rank: int, store: str, results: str) -> None:
    """capture_each with stand-ins for captures: all kept, one rank failing part way, and ranks
    at different captures as they meet at a barrier."""
    _join(rank, store)
    ranks = RankGroup(None, timeout=30)
    outcome, discarded = {}, []

    def made(fail_at=None):
        def attempt(index, barrier):
            if index == fail_at:
                raise RuntimeError(f"rank {rank} fails capture {index}")
            return f"capture {index}"
        return attempt

    outcome["kept"] = ranks.capture_each([16, 8, 4], made(), discarded.append)
    outcome["exchanges_when_kept"] = ranks.agreement.exchanges
    try:
        ranks.capture_each([16, 8, 4], made(fail_at=1 if rank == 2 else None), discarded.append)
    except bg.PeerCaptureError as error:
        outcome["raised"] = ["peer", list(error.ranks)]
    except RuntimeError as error:
        outcome["raised"] = ["own", str(error)]
    outcome["discarded"], discarded = discarded, []

    def at_a_barrier(index, barrier):
        barrier()
        return index

    try:
        ranks.capture_each([16, 8 + (rank == 1)], at_a_barrier, discarded.append)
    except bg.PeerCaptureError as error:
        outcome["out_of_step"] = error.out_of_step
    outcome["discarded_out_of_step"] = discarded
    with open(os.path.join(results, f"{rank}.json"), "w") as out:
        json.dump(outcome, out)
    dist.destroy_process_group()


def test_captures_made_under_one_agreement_are_kept_on_every_rank_or_discarded_on_every_rank(tmp_path):
    for rank, outcome in enumerate(_run(tmp_path, _capturing_each)):
        assert outcome["kept"] == ["capture 0", "capture 1", "capture 2"]
        assert outcome["exchanges_when_kept"] == 1  # the ranks met once, for all three
        if rank == 2:  # failed at its second capture: raises its own error, and drops its first
            assert outcome["raised"] == ["own", "rank 2 fails capture 1"]
            assert outcome["discarded"] == [["capture 0"]]
        else:  # every capture made, then all given up at the end, with the rank that failed named
            assert outcome["raised"] == ["peer", [2]]
            assert outcome["discarded"] == [["capture 0", "capture 1", "capture 2"]]
        assert outcome["out_of_step"] is True  # rank 1 met the others' size-8 barrier at size 9
        assert outcome["discarded_out_of_step"] == [[0]]  # what each had made before: the size-16 capture


class _StandIn:
    """What the policy keeps of a capture, without a GPU: a graph that can be reset."""

    draws_random_numbers = False

    def __init__(self, size: int, resets: list):
        self.graph = self
        self.size, self.resets = size, resets

    def reset(self) -> None:
        self.resets.append(self.size)


def _warming_up_under_one_agreement(rank: int, store: str, results: str) -> None:
    """capture_together with a warm-up before every size: rank 2's capture at size 8 fails
    after its warm-up, so its peers must not run size 4's warm-up collective without it."""
    _join(rank, store)
    ranks = RankGroup(None, timeout=30)
    inputs = StaticInputs(torch.zeros(16, 2))
    policy = CapturePolicy(lambda x: x, inputs, {None: "breakable"}, bg.RunnerOptions(warmup=1, group=dist.group.WORLD), ranks)
    warmed, resets = [], []

    def stand_in(barrier, key, size, warmup, pool, measure):
        if warmup:
            dist.all_reduce(torch.ones(1))  # the step's collective, run for real by the warm-up
            warmed.append(size)
        if rank == 2 and size == 8:
            raise RuntimeError("rank 2 fails the capture of size 8")
        return _StandIn(size, resets)

    policy._graphed_with = stand_in
    started = time.monotonic()
    together = policy.capture_together([(None, 16), (None, 8), (None, 4)], None, lambda: None)
    outcome = {"together": together, "seconds": time.monotonic() - started, "warmed": warmed, "resets": resets,
               "kept": sorted(size for _key, size in policy.graphed)}
    with open(os.path.join(results, f"{rank}.json"), "w") as out:
        json.dump(outcome, out)
    dist.destroy_process_group()


def test_under_one_agreement_no_rank_warms_up_while_a_peer_that_failed_waits_to_say_so(tmp_path):
    for rank, outcome in enumerate(_run(tmp_path, _warming_up_under_one_agreement)):
        assert outcome["together"] is False and outcome["kept"] == [], outcome  # every rank falls back
        assert outcome["warmed"] == [16, 8], outcome  # nobody ran size 4's warm-up collective
        assert outcome["resets"] == ([16] if rank == 2 else [16, 8]), outcome
        assert outcome["seconds"] < 20, outcome  # not a peer timeout


def _losing_a_peer(rank: int, store: str, results: str) -> None:
    _join(rank, store)
    ranks = RankGroup(None, timeout=20)
    dist.barrier()  # every rank's exchange group is connected: rank 1 leaves none half-made
    if rank == 1:
        os._exit(0)  # gone without a word, mid-job
    started = time.monotonic()
    try:
        ranks.dispatch(1, [0])
        outcome = {"raised": None}
    except bg.PeerCaptureError as error:
        outcome = {"raised": str(error), "lost": error.lost, "seconds": time.monotonic() - started}
    with open(os.path.join(results, f"{rank}.json"), "w") as out:
        json.dump(outcome, out)
    os._exit(0)  # the process group cannot be left in order with a peer gone


def test_a_peer_whose_process_is_gone_makes_the_others_raise_within_the_timeout(tmp_path):
    store, results = tmp_path / "store", tmp_path / "results"
    results.mkdir()
    mp.spawn(_losing_a_peer, args=(str(store), str(results)), nprocs=WORLD, join=True)
    for rank in (0, 2):
        outcome = json.loads((results / f"{rank}.json").read_text())
        assert outcome["raised"] and outcome["lost"], outcome
        assert "process is gone" in outcome["raised"]
        assert outcome["seconds"] < 20 + 10, outcome


def test_group_options_are_checked():
    with pytest.raises(TypeError, match="ProcessGroup"):
        bg.RunnerOptions(group="tp")
    for never in (0, float("inf"), float("nan")):  # inf and nan would fail only at the first exchange
        with pytest.raises(ValueError, match="peer_timeout must be a finite number of seconds > 0"):
            bg.RunnerOptions(peer_timeout=never)
    with pytest.raises(TypeError, match="agree_batches"):
        bg.RunnerOptions(agree_batches="yes")


def test_a_group_needs_torch_distributed_started():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        RankGroup(None, timeout=5)
