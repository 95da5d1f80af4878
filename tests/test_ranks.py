"""Ranks that agree, on CPU processes over gloo: the protocol, not NCCL or graphs.

Each scenario is a capture every rank runs: some barriers, perhaps a failure
before one of them (or after the last, as a failed instantiation would), a
tag. The ranks run many scenarios in a row in one process group, so a
scenario that left the ranks out of step would break the ones after it.
"""

import json
import os
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import breakgraph as bg
from breakgraph.base.ranks import PeerBarrier

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")


class SimulatedCaptureError(RuntimeError):
    """What a rank's own failed capture raises in these tests."""


def _capture(agreement: bg.CaptureAgreement, barriers: int, fail_at: int | None) -> None:
    """A capture as the agreement sees it: ``barriers`` barrier_fn calls, and a failure
    before barrier ``fail_at`` (``fail_at == barriers``: after the last one)."""
    with agreement:
        for index in range(barriers):
            if fail_at == index:
                raise SimulatedCaptureError(f"failed before barrier {index}")
            agreement.barrier()
        if fail_at == barriers:  # after the capture's end barrier, inside 'with agreement:'
            raise SimulatedCaptureError("failed after the last barrier")


def _rank_main(rank: int, world: int, store: str, scenarios: list, results: str) -> None:
    # A rank left waiting (a protocol out of step) times out and fails the test instead of hanging it.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=10),
    )
    try:
        discarded = []
        agreement = bg.CaptureAgreement(discard=lambda: discarded.append(True))  # one object, entered again and again
        outcomes = []
        for scenario in scenarios:
            barriers, fail_at, tag = scenario[rank]
            agreement.tag, before, discarded[:] = tag, agreement.exchanges, []
            try:
                _capture(agreement, barriers, fail_at)
                outcome = ["kept"]
            except SimulatedCaptureError:
                outcome = ["own"]
            except bg.PeerCaptureError as error:
                assert error.out_of_step != bool(error.ranks)
                outcome = ["peer", list(error.ranks)] if error.ranks else ["out_of_step"]
            outcomes.append([outcome, agreement.exchanges - before, bool(discarded)])
        sizes = [bg.agreed_batch_size(n) for n in (rank + 1, 7 * (rank == 0), 0)]
        with open(os.path.join(results, f"{rank}.json"), "w") as out:
            json.dump({"outcomes": outcomes, "sizes": sizes}, out)
    finally:
        dist.destroy_process_group()


def _expected(scenario: list) -> tuple[list, int, list[bool]]:
    """The protocol's model: synchronous exchanges until one settles the capture.
    Returns each rank's outcome, the number of exchanges, and who discards."""
    world, exchange = len(scenario), 0
    while True:
        reports = []
        for barriers, fail_at, tag in scenario:
            step = "failed" if fail_at == exchange else ("barrier" if exchange < barriers else "end")
            reports.append((step, tag))
        exchange += 1
        failed = [rank for rank, (step, _tag) in enumerate(reports) if step == "failed"]
        at_end = [step == "end" for step, _tag in reports]
        if failed:
            outcomes = [["own"] if rank in failed else ["peer", failed] for rank in range(world)]
            return outcomes, exchange, at_end
        if len(set(reports)) > 1:
            return [["out_of_step"]] * world, exchange, at_end
        if reports[0][0] == "end":
            return [["kept"]] * world, exchange, [False] * world


def _run_ranks(tmp_path, scenarios: list, world: int) -> list[dict]:
    store, results = tmp_path / "store", tmp_path / "results"
    results.mkdir()
    mp.spawn(
        _rank_main,
        args=(world, str(store), scenarios, str(results)),
        nprocs=world,
        join=True,
    )
    return [json.loads((results / f"{rank}.json").read_text()) for rank in range(world)]


def _scenarios(world: int):
    """Mostly the same program on every rank (tensor parallel), sometimes out of step."""
    same = st.tuples(st.integers(0, 4), st.integers(-3, 3)).flatmap(
        lambda program: st.lists(
            st.tuples(
                st.just(program[0]),
                st.none() | st.integers(0, program[0]),
                st.just(program[1]),
            ),
            min_size=world,
            max_size=world,
        )
    )
    different = st.lists(
        st.tuples(
            st.integers(0, 3),
            st.none() | st.integers(0, 3),
            st.sampled_from([None, -1, 0, 2]),
        ),
        min_size=world,
        max_size=world,
    )
    return st.lists(st.one_of(same, same, different), min_size=1, max_size=12)


# Each example spawns the ranks, so few examples, each a long sequence; no shrinking (a
# shrink step respawns them, and a wrong protocol waits out a timeout at every step).
@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), world=st.sampled_from([2, 3]))
def test_every_rank_keeps_its_capture_or_every_rank_raises(tmp_path_factory, data, world):
    scenarios = data.draw(_scenarios(world))
    ranks = _run_ranks(tmp_path_factory.mktemp("ranks"), scenarios, world)
    for index, scenario in enumerate(scenarios):
        outcomes, exchanges, at_end = _expected(scenario)
        for rank in range(world):
            outcome, made, discarded = ranks[rank]["outcomes"][index]
            assert outcome == outcomes[rank], (scenario, rank)
            # In step: the next scenario pairs the same collectives.
            assert made == exchanges, (scenario, rank)
            assert discarded == (at_end[rank] and outcome != ["kept"]), (scenario, rank)


def test_one_rank_failing_makes_the_others_raise_and_the_next_capture_works(tmp_path):
    scenarios = [
        [(3, None, 8), (3, 1, 8)],  # rank 1 fails before its second barrier
        [(3, None, 8), (3, None, 8)],  # the next capture, on both ranks
        [(2, 2, 4), (2, None, 4)],  # rank 0 fails after its end barrier, inside the agreement
        [(2, None, 4), (2, None, 16)],  # different batch sizes: out of step at the first barrier
        [(1, None, None), (2, None, None)],  # different breaks: rank 0 at the end, rank 1 at a barrier
        [(0, None, 1), (0, None, 1)],
        [(1, None, -1), (1, None, 0)],  # tags that differ only in sign
    ]
    ranks = _run_ranks(tmp_path, scenarios, world=2)
    outcomes = [[outcome[0] for outcome in rank["outcomes"]] for rank in ranks]
    assert outcomes[0] == [["peer", [1]], ["kept"], ["own"], ["out_of_step"], ["out_of_step"], ["kept"], ["out_of_step"]]
    assert outcomes[1] == [["own"], ["kept"], ["peer", [0]], ["out_of_step"], ["out_of_step"], ["kept"], ["out_of_step"]]
    discarded = [[outcome[2] for outcome in rank["outcomes"]] for rank in ranks]  # only a rank that reached the end
    assert discarded == [[False, False, False, False, True, False, False], [False, False, True, False, False, False, False]]
    assert all(rank["sizes"] == [2, 7, 0] for rank in ranks)  # the largest batch of any rank


def test_agreement_errors_say_what_to_do():
    with pytest.raises(TypeError, match="discard must be callable"):
        bg.CaptureAgreement(discard=42)
    with pytest.raises(TypeError, match="tag must be a 64-bit int"):
        bg.CaptureAgreement(tag="8")
    with pytest.raises(TypeError, match="tag must be a 64-bit int"):
        bg.CaptureAgreement().tag = 2**63
    with pytest.raises(RuntimeError, match="inside 'with agreement:'"):
        bg.CaptureAgreement().barrier()
    if not dist.is_initialized():
        with (
            pytest.raises(RuntimeError, match="init_process_group"),
            bg.CaptureAgreement(),
        ):
            pass
        with pytest.raises(ValueError, match="batch size"):
            bg.agreed_batch_size(-1)


def test_a_peer_barrier_passes_through_and_remembers_quiet_breaks():
    met = []
    peers = PeerBarrier(lambda: met.append("met"))
    peers()
    assert met == ["met"]

    def attention(x):
        return x

    class Unhashable:
        __eq__ = object.__eq__  # and so no __hash__
        __hash__ = None

        def __call__(self, x):
            return x

    assert not peers.is_quiet(attention)
    peers.found_quiet(attention)
    peers.found_quiet(Unhashable())  # watched every time rather than remembered
    assert peers.is_quiet(attention) and not peers.is_quiet(Unhashable())
    assert peers.quiet == {attention}
