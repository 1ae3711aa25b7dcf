"""The pure placement policy (pytest_ctresources/xdist/placement.py): fits, skips, order,
packing, the simulated wall time, shards."""

from __future__ import annotations

import pytest

from pytest_ctresources.xdist.placement import (
    Demand,
    Dispatcher,
    Gpu,
    PlacementPolicy,
    fits_of,
    fitted_lower_bound,
    lower_bound,
    parse_shard,
    refill,
    room_for,
    shard,
    simulate,
)

SMALL = Gpu("S", "GPU 0 (Fake 24)", 24.0, 2)
BIG = Gpu("B", "GPU 1 (Fake 80)", 80.0, 2)
GPUS = [SMALL, BIG]


def demands(*needs: float | None, duration: float = 1.0) -> list[Demand]:
    return [Demand(f"t::{n}", need, duration) for n, need in enumerate(needs)]


def test_a_test_fits_the_gpus_that_hold_it_and_one_none_holds_skips_naming_the_largest() -> None:
    fits = fits_of(GPUS, demands(10, 30, 90, None))
    assert [f.gpus for f in fits] == [("S", "B"), ("B",), ("B",), ("S", "B")]
    assert [f.skip_reason for f in fits[:2]] == [None, None]
    assert fits[2].skip_reason == (
        "needs 90.0 GiB VRAM; the largest GPU in this run, GPU 1 (Fake 80), has 80.0 GiB"
    )
    assert fits[2].duration_s == 0.0  # a skip costs nothing


def test_without_gpus_every_test_may_run_anywhere() -> None:
    fits = fits_of([], demands(10, None))
    dispatcher = Dispatcher([], fits)
    assert [f.skip_reason for f in fits] == [None, None]
    assert {dispatcher.next_for(None, None), dispatcher.next_for(None, None)} == {0, 1}


def test_a_worker_gets_only_what_its_gpu_holds_constrained_tests_first_then_longest() -> None:
    tests = [
        Demand("flex-short", 5, 1.0),
        Demand("flex-long", 5, 50.0),
        Demand("big-only", 30, 2.0),
        Demand("too-big", 200, 9.0),
    ]
    dispatcher = Dispatcher(GPUS, fits_of(GPUS, tests))
    assert dispatcher.next_for("S", None) == 1  # the longest the small GPU holds
    assert dispatcher.next_for("S", None) == 0
    assert dispatcher.next_for("S", None) is None
    assert not dispatcher.can_use("S")
    assert dispatcher.next_for("B", None) == 3  # skips first: they cost nothing
    assert dispatcher.next_for("B", None) == 2
    assert dispatcher.pending == 0


def test_lpt_breaks_equal_durations_by_need() -> None:
    dispatcher = Dispatcher(GPUS, fits_of(GPUS, demands(2, 12, 6, duration=3.0)))
    assert [dispatcher.next_for("S", None) for _ in range(3)] == [1, 2, 0]


def test_a_test_that_does_not_fit_the_room_waits_for_a_smaller_one_to_go_first() -> None:
    dispatcher = Dispatcher(GPUS, fits_of(GPUS, [Demand("a", 20, 9.0), Demand("b", 4, 1.0)]))
    assert dispatcher.next_for("S", room_gib=10.0) == 1
    assert dispatcher.next_for("S", room_gib=10.0) is None
    assert dispatcher.can_use("S")  # it waits for room; it is not shut down
    assert dispatcher.next_for("S", room_gib=24.0) == 0


def test_put_back_hands_a_test_out_again() -> None:
    dispatcher = Dispatcher(GPUS, fits_of(GPUS, demands(1, 2)))
    first = dispatcher.next_for("S", None)
    assert first is not None
    assert first is not None
    dispatcher.put_back(first)
    assert dispatcher.next_for("B", None) == first


def test_room_counts_the_largest_queued_need_of_each_other_worker() -> None:
    assert room_for(80.0, [[30.0, 10.0], [5.0], []]) == 45.0


def test_refill_tops_up_to_two_and_a_second_test_is_given_whatever_the_room() -> None:
    dispatcher = Dispatcher(GPUS, fits_of(GPUS, demands(20, 20)))
    queue: list[int] = []
    # The other worker holds 20 of 24 GiB: an idle worker gets nothing and waits.
    assert refill(dispatcher, "S", queue, [[20.0]]) is False
    assert queue == []
    first = dispatcher.next_for("S", None)
    assert first is not None
    queue = [first]  # one queued: an xdist worker needs the next to start it
    assert refill(dispatcher, "S", queue, [[20.0]]) is False
    assert queue == [first, 1 - first]
    assert refill(dispatcher, "S", [], []) is True  # nothing left: shut down


def test_the_simulation_runs_each_test_where_it_fits_and_skips_only_the_too_big() -> None:
    needs = [10, 20, 30, 60, 90, None, 3]
    fits = fits_of(GPUS, demands(*needs, duration=2.0))
    outcome = simulate(GPUS, fits, PlacementPolicy(Dispatcher(GPUS, fits)))
    assert outcome.skipped == {4: fits[4].skip_reason}
    assert outcome.ran[2] == "B" and outcome.ran[3] == "B"
    capacity = {gpu.key: gpu.capacity_gib for gpu in GPUS}
    for i, key in outcome.ran.items():
        assert (needs[i] or 0) <= capacity[key]


def test_packing_reaches_the_lower_bound_when_every_test_fits() -> None:
    fits = fits_of(GPUS, [Demand(f"t{i}", 5.0, float(1 + i % 7)) for i in range(200)])
    outcome = simulate(GPUS, fits, PlacementPolicy(Dispatcher(GPUS, fits)))
    assert len(outcome.ran) == 200
    assert outcome.wall_s <= 1.02 * lower_bound(GPUS, fits)


def test_leases_never_overlap_beyond_a_card_in_the_simulation() -> None:
    # Two 15 GiB tests cannot share the 24 GiB card: the room keeps them apart.
    gpus = [SMALL]
    fits = fits_of(gpus, demands(15, 15, 15, 15, duration=1.0))
    outcome = simulate(gpus, fits, PlacementPolicy(Dispatcher(gpus, fits)))
    assert len(outcome.ran) == 4
    assert outcome.wall_s == pytest.approx(4.0)


def test_the_fitted_bound_counts_tests_only_the_big_gpus_hold() -> None:
    fits = fits_of(GPUS, demands(30, 30, 30, 30, duration=10.0))
    assert lower_bound(GPUS, fits) == 10.0  # 40 s of work over 4 slots
    assert fitted_lower_bound(GPUS, fits) == 20.0  # only the two slots of the 80 GiB card


def test_a_shard_runs_each_test_once_on_the_smallest_runner_class_that_fits() -> None:
    tests = [
        Demand(f"t{i}", need, float(d))
        for i, (need, d) in enumerate(
            [(10, 5), (10, 4), (10, 3), (30, 8), (60, 2), (None, 1), (200, 7)]
        )
    ]
    shares = shard(tests, [24, 24, 80])
    assert sorted(i for share in shares for i in share.tests) == list(range(7))
    assert set(shares[2].tests) == {3, 4, 6}  # 30, 60 and the too-big one: the 80 GiB class
    small = [shares[0].predicted_s, shares[1].predicted_s]
    assert sorted(small) == [6.0, 7.0]  # 5+1 and 4+3: balanced by duration
    assert shard(tests, [24, 24, 80]) == shares  # stable


def test_shard_parsing() -> None:
    assert parse_shard("2/5") == (2, 5)
    for bad in ("0/3", "4/3", "x", "2"):
        with pytest.raises(ValueError, match="K/N"):
            parse_shard(bad)


def test_the_fitted_bound_counts_what_cannot_run_beside_a_test_over_half_a_gpu() -> None:
    big = [Gpu("B", "GPU 0 (Fake 80)", 80.0, 2)]
    fits = fits_of(big, demands(60, 30, 30, duration=10.0))
    # The 60 runs alone (no 30 fits beside it); the two 30s together: 10 + 10 s.
    assert fitted_lower_bound(big, fits) == 20.0
    outcome = simulate(big, fits, PlacementPolicy(Dispatcher(big, fits)))
    assert outcome.wall_s == pytest.approx(20.0)
