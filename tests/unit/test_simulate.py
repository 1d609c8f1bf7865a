"""The goodput simulator: Daly's expectation where it is exact, the edge cases of issue 14, failures during
saves, background writes and restarts, node losses against the tiers, the strategies and their errors."""

from __future__ import annotations

import itertools
import random

import pytest

import tiersave.planner.simulate as sim
from tiersave.errors import ConfigError
from tiersave.planner.bandwidth import TierSpec
from tiersave.planner.interval import expected_goodput
from tiersave.planner.simulate import (
    CRASH,
    NODE_LOSS,
    FailureSpec,
    SimTier,
    Strategy,
    compare,
    failure_trace,
    run_trace,
)
from tiersave.planner.simulate_strategies import JobSpec, TierKind, build_strategies, tier_kind

DAY = 86_400.0


def fixed(interval: float, cost: float, restart: float = 0.0) -> Strategy:
    return Strategy(name="fixed", interval_s=interval, blocked_s=cost, tiers=(SimTier(name="d"),), reschedule_s=restart)


def seeds_job(**changes: object) -> JobSpec:
    base: dict[str, object] = {
        "mttf_s": 124 * 60.0,
        "accelerators": 24_000,
        "checkpoint_bytes": 4_870_000_000_000,
        "stage_cost_s": 2.0,
        "reschedule_s": 300.0,
        "fixed_period_s": 372.0,
        "tiers": (TierSpec(name="durable", bandwidth_bytes_per_s=100e9),),
    }
    base.update(changes)
    return JobSpec(**base)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- analytic cross-check


@pytest.mark.parametrize(
    ("interval", "cost", "mttf", "restart"),
    [
        (600.0, 60.0, 7200.0, 600.0),  # a typical job
        (3600.0, 30.0, 600.0, 60.0),  # failures far more frequent than checkpoints
        (300.0, 0.0, 3600.0, 120.0),  # zero-cost checkpoints
        (300.0, 20.0, 1800.0, 3600.0),  # a restart longer than the MTTF
    ],
    ids=["typical", "failures-more-frequent", "zero-cost", "restart-longer-than-mttf"],
)
def test_exponential_fixed_interval_matches_daly(interval: float, cost: float, mttf: float, restart: float) -> None:
    result = compare([fixed(interval, cost, restart)], FailureSpec(mttf_s=mttf), days=200, runs=10, seed=11)
    r = result.results[0]
    expected = expected_goodput(interval, cost, mttf, restart)
    lo, hi = r.goodput_ci95
    assert lo <= expected <= hi, (expected, r.goodput_ci95)
    assert r.goodput == pytest.approx(expected, abs=0.01)


def test_the_time_adds_up() -> None:
    times, kinds = failure_trace(FailureSpec(mttf_s=3000), 20 * DAY, random.Random(4))
    for strategy in build_strategies(seeds_job(mttf_s=3000.0), ["fixed", "young", "async", "tiered"])[0]:
        t = run_trace(strategy, times, kinds, 20 * DAY)
        assert t.useful_s + t.recompute_s + t.blocked_s + t.restart_s == pytest.approx(t.wall_s, rel=1e-9)
        assert t.failures == len(times)
        assert min(t.useful_s, t.recompute_s, t.blocked_s, t.restart_s) >= 0


def test_same_seed_same_figures_other_seed_others() -> None:
    strategies = build_strategies(seeds_job())[0]
    a = compare(strategies, FailureSpec(mttf_s=7440), days=5, runs=3, seed=7)
    b = compare(strategies, FailureSpec(mttf_s=7440), days=5, runs=3, seed=7)
    c = compare(strategies, FailureSpec(mttf_s=7440), days=5, runs=3, seed=8)
    assert [r.goodput for r in a.results] == [r.goodput for r in b.results]
    assert [r.tallies for r in a.results] == [r.tallies for r in b.results]
    assert a.failures_per_run != c.failures_per_run


def test_strategies_share_one_failure_trace() -> None:
    result = compare(build_strategies(seeds_job())[0], FailureSpec(mttf_s=7440), days=3, runs=2, seed=1)
    counts = {tuple(t.failures for t in r.tallies) for r in result.results}
    assert counts == {result.failures_per_run}


def test_cycle_jumps_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jumping over repeating cycles gives the figures of stepping through every save."""
    job = seeds_job(
        fixed_period_s=1200.0,
        tiers=(
            TierSpec(name="durable", bandwidth_bytes_per_s=10e9),
            TierSpec(name="local", every=3, bandwidth_bytes_per_s=1e12),
        ),
    )
    strategies = build_strategies(job, ["fixed", "young", "async", "tiered", "tiered-nopeer"])[0]
    times, kinds = failure_trace(FailureSpec(mttf_s=job.mttf_s, weibull_shape=0.7), 20 * DAY, random.Random(5))
    jumped = [run_trace(s, times, kinds, 20 * DAY) for s in strategies]
    counter = iter(range(10**9))
    monkeypatch.setattr(sim._Run, "signature", lambda self, t, work: (next(counter),))  # never repeats
    stepped = [run_trace(s, times, kinds, 20 * DAY) for s in strategies]
    for a, b in zip(jumped, stepped, strict=True):
        assert a.saves == b.saves
        assert a.goodput == pytest.approx(b.goodput, rel=1e-9)
        assert a.bytes_by_tier == pytest.approx(b.bytes_by_tier, rel=1e-9)
        assert a.restores_by_tier == b.restores_by_tier


# ---------------------------------------------------------------------------------------------- edge cases


def test_no_failures() -> None:
    t = run_trace(fixed(540.0, 60.0), [], [], 10 * DAY)
    assert t.failures == 0 and t.recompute_s == 0 and t.restart_s == 0
    assert t.goodput == pytest.approx(0.9, abs=1e-3)
    free = run_trace(fixed(540.0, 0.0), [], [], 10 * DAY)
    assert free.goodput == 1.0 and free.blocked_s == 0


def test_a_failure_during_a_save_loses_that_checkpoint() -> None:
    # saves block [100, 110) and [210, 220); the second is cut at 215, so work returns to the first's 100 s
    t = run_trace(fixed(100.0, 10.0), [215.0], [CRASH], 1000.0)
    assert t.recompute_s == pytest.approx(100.0)
    assert t.blocked_s == pytest.approx(10.0 + 5.0 + 10.0 * t.saves - 10.0)


def test_a_failure_during_a_background_write_falls_back() -> None:
    """The first async save is written from 101 s to 151 s; a crash at 120 s finds no checkpoint."""
    s = Strategy(name="async", interval_s=100.0, blocked_s=1.0, tiers=(SimTier(name="d", write_s=50.0),))
    t = run_trace(s, [120.0], [CRASH], 1000.0)
    assert t.restarts_from_scratch == 1
    assert t.recompute_s == pytest.approx(119.0)
    after = run_trace(s, [160.0], [CRASH], 1000.0)  # written by then: back to 100 s of work
    assert after.restarts_from_scratch == 0 and after.recompute_s == pytest.approx(159.0 - 100.0)


def test_failures_during_a_restart_restart_it() -> None:
    t = run_trace(fixed(100.0, 0.0, restart=50.0), [150.0, 170.0, 190.0], [CRASH] * 3, 1000.0)
    # down from 150 s: restarts at 170 and 190 are cut short, the last one ends at 240 s
    assert t.restart_s == pytest.approx(90.0)
    assert t.restores_by_tier == [1]


def test_a_save_waits_for_the_previous_write() -> None:
    """The staging buffer is reused: a 50 s write caps an async job saving every 10 s at one save per 51 s."""
    s = Strategy(name="async", interval_s=10.0, blocked_s=1.0, tiers=(SimTier(name="d", write_s=50.0),))
    t = run_trace(s, [], [], 10_000.0)
    assert t.goodput == pytest.approx(10.0 / 51.0, rel=0.01)


def test_a_busy_later_tier_catches_up_on_the_newest_save() -> None:
    """A 100 s durable write behind saves every 31 s: deferred saves are replaced by newer ones."""
    tiers = (SimTier(name="memory", bytes_per_write=1), SimTier(name="durable", write_s=100.0, bytes_per_write=1))
    t = run_trace(Strategy(name="tiered", interval_s=30.0, blocked_s=1.0, tiers=tiers), [], [], 31_010.0)
    assert t.bytes_by_tier[0] == t.saves == 1000
    assert t.bytes_by_tier[1] == pytest.approx(31_000 / 100, rel=0.02)  # busy all the time, not 1000 writes


def tiered_two(peer: bool) -> Strategy:
    tiers = [SimTier(name="memory", restore_s=1.0, survives_node_loss=False)]
    if peer:
        tiers.append(SimTier(name="peer", write_s=5.0, restore_s=5.0))
    tiers.append(SimTier(name="durable", write_s=50.0, restore_s=50.0, every=4))
    return Strategy(name="t", interval_s=100.0, blocked_s=1.0, tiers=tuple(tiers), reschedule_s=10.0)


@pytest.mark.parametrize(
    ("kind", "peer", "restored_from"),
    [(CRASH, False, "memory"), (NODE_LOSS, False, "durable"), (NODE_LOSS, True, "peer"), (CRASH, True, "memory")],
)
def test_restore_from_the_fastest_tier_that_survived(kind: int, peer: bool, restored_from: str) -> None:
    # saves of 100, 200, 300, 400 (durable) and 500 s of work end at 101, 202, 303, 404, 505 s; the failure at
    # 560 s finds 555 s of work done
    s = tiered_two(peer)
    t = run_trace(s, [560.0], [kind], 2000.0)
    names = [tier.name for tier in s.tiers]
    assert t.restores_by_tier[names.index(restored_from)] == 1
    lost = {"memory": 555 - 500, "peer": 555 - 500, "durable": 555 - 400}[restored_from]
    assert t.recompute_s == pytest.approx(lost)


def test_node_losses_cost_more_without_a_peer_replica() -> None:
    spec = FailureSpec(mttf_s=3600, node_loss_share=1.0)
    result = compare(
        [tiered_two(True), Strategy(**{**_fields(tiered_two(False)), "name": "nopeer"})], spec, days=20, runs=4
    )
    with_peer, without = result.results
    assert with_peer.goodput > without.goodput
    crashes = compare([tiered_two(False)], FailureSpec(mttf_s=3600, node_loss_share=0.0), days=20, runs=4)
    assert crashes.results[0].goodput > without.goodput


def _fields(s: Strategy) -> dict[str, object]:
    return {f: getattr(s, f) for f in ("name", "interval_s", "blocked_s", "tiers", "reschedule_s")}


# ------------------------------------------------------------------------------------------ failure traces


def test_weibull_keeps_the_mean_and_replay_keeps_the_times() -> None:
    times, _ = failure_trace(FailureSpec(mttf_s=1000.0, weibull_shape=0.6), 20_000_000.0, random.Random(2))
    assert len(times) == pytest.approx(20_000, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    short = sum(g < 100 for g in gaps) / len(gaps)
    assert short > 0.15  # clustered: exponential would give 1 - exp(-0.1) = 9.5%
    spec = FailureSpec(mttf_s=1.0, replay=(10.0, 20.0, 5000.0), replay_kinds=(CRASH, NODE_LOSS, CRASH))
    assert failure_trace(spec, 1000.0, random.Random(0)) == ([10.0, 20.0], [CRASH, NODE_LOSS])


def test_node_loss_share_is_respected() -> None:
    _, kinds = failure_trace(FailureSpec(mttf_s=10.0, node_loss_share=0.25), 100_000.0, random.Random(3))
    assert sum(kinds) / len(kinds) == pytest.approx(0.25, abs=0.02)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mttf_s": 0.0}, "MTTF"),
        ({"weibull_shape": -1.0}, "Weibull"),
        ({"node_loss_share": 1.5}, "node-loss share"),
        ({"replay": (5.0, 1.0)}, "increasing"),
        ({"replay": (1.0,), "replay_kinds": (0, 1)}, "one kind"),
    ],
)
def test_bad_failure_specs(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FailureSpec(**{"mttf_s": 10.0, **changes})  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ strategies


def test_tier_kinds_by_name() -> None:
    assert [tier_kind(n) for n in ("memory", "shm", "local", "nvme-0", "peer", "s3", "durable")] == [
        TierKind.MEMORY,
        TierKind.MEMORY,
        TierKind.LOCAL,
        TierKind.LOCAL,
        TierKind.PEER,
        TierKind.DURABLE,
        TierKind.DURABLE,
    ]


def test_the_seeds_example_orders_the_strategies() -> None:
    strategies, notes = build_strategies(seeds_job())
    assert [s.name for s in strategies] == ["fixed", "young", "async", "tiered"]
    fixed_s, young_s, async_s, tiered_s = strategies
    assert fixed_s.blocked_s == young_s.blocked_s == pytest.approx(48.7)
    assert fixed_s.interval_s + fixed_s.blocked_s == pytest.approx(372.0)
    assert async_s.blocked_s == tiered_s.blocked_s == 2.0
    assert [t.name for t in tiered_s.tiers] == ["memory", "peer", "durable"]
    assert any("2 s (given)" in n for n in notes)
    result = compare(strategies, FailureSpec(mttf_s=7440.0), days=20, runs=5, seed=0)
    goodputs = [r.goodput for r in result.results]
    assert goodputs == sorted(goodputs)  # fixed < young < async < tiered on this job


def test_the_durable_cadence_keeps_up() -> None:
    strategies, _ = build_strategies(seeds_job(tiers=(TierSpec(name="s3", bandwidth_bytes_per_s=5e9),)), ["tiered"])
    durable = strategies[0].tiers[-1]
    period = strategies[0].interval_s + strategies[0].blocked_s
    assert durable.name == "s3" and durable.every * period >= durable.write_s > (durable.every - 1) * period


@pytest.mark.parametrize(
    ("changes", "names", "message"),
    [
        ({}, ["bogus"], "unknown strategy"),
        ({"tiers": (), "checkpoint_bytes": None}, ["fixed"], "synchronous save"),
        ({"tiers": ()}, ["async"], "durable"),
        ({"checkpoint_bytes": None, "sync_cost_s": 30.0}, ["tiered"], "checkpoint size"),
        ({"fixed_period_s": 40.0}, ["fixed"], "does not fit"),
    ],
)
def test_strategies_say_what_they_miss(changes: dict[str, object], names: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_strategies(seeds_job(**changes), names)


def test_compare_rejects_bad_requests() -> None:
    s = fixed(100.0, 1.0)
    spec = FailureSpec(mttf_s=100.0)
    with pytest.raises(ConfigError, match="at least one strategy"):
        compare([], spec, days=1)
    with pytest.raises(ConfigError, match="must differ"):
        compare([s, s], spec, days=1)
    with pytest.raises(ConfigError, match="simulated days"):
        compare([s], spec, days=0)
    with pytest.raises(ConfigError, match="runs"):
        compare([s], spec, days=1, runs=0)
    with pytest.raises(ConfigError, match="interval"):
        fixed(0.0, 1.0)
    with pytest.raises(ConfigError, match="one kind per failure time"):
        run_trace(s, [1.0, 2.0], [CRASH], 100.0)
