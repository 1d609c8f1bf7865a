"""Failure model, Young/Daly, goodput, bandwidth needs and the schedule policies, on hand-computed values."""

from __future__ import annotations

import doctest
import itertools
import math
from collections.abc import Callable

import pytest

from tiersave.errors import ConfigError
from tiersave.planner.bandwidth import TierSpec, plan_bandwidth, tier_every_for
from tiersave.planner.failures import Component, FailureModel, cluster_mttf_s
from tiersave.planner.interval import daly_interval_s, expected_goodput, plan_interval, young_interval_s
from tiersave.planner.schedule import AutoSchedule, EveryNSteps, EverySeconds, SaveCost, Schedule, parse_schedule
from tiersave.units import format_duration, parse_duration

HOUR = 3600.0
LLAMA3_405B_12_BYTES = 12 * 405_853_388_800  # bf16-adam-master, see test_sizing

# ------------------------------------------------------------------------------------------ failure model


def test_cluster_mttf_adds_failure_rates() -> None:
    assert cluster_mttf_s([Component(name="gpu", count=1000, mttf_s=1000 * HOUR)]) == HOUR
    # 10,000 GPUs at 20,000 h and 1,250 hosts at 10,000 h: 0.5 + 0.125 failures per hour -> 1.6 h
    parts = [
        Component(name="gpu", count=10_000, mttf_s=20_000 * HOUR),
        Component(name="host", count=1_250, mttf_s=10_000 * HOUR),
    ]
    assert cluster_mttf_s(parts) == pytest.approx(1.6 * HOUR)
    model = FailureModel.from_components(parts, accelerators=10_000)
    assert model.cluster_mttf_s == pytest.approx(1.6 * HOUR)
    # the same parts per accelerator on twice the cluster fail twice as often
    assert model.scaled_to(20_000).cluster_mttf_s == pytest.approx(0.8 * HOUR)


def test_observed_record_gives_per_accelerator_mttf_and_scales() -> None:
    # Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs
    record = FailureModel.from_record(interruptions=419, days=54, accelerators=16_384)
    assert record.cluster_mttf_s == pytest.approx(54 * 86_400 / 419)  # 185.6 min
    assert record.accelerator_mttf_s == pytest.approx(54 * 86_400 * 16_384 / 419)
    scaled = FailureModel.from_record(interruptions=419, days=54, accelerators=16_384, scale_to=24_000)
    assert scaled.cluster_mttf_s / 60 == pytest.approx(126.69, abs=0.01)
    assert "scaled from 16,384 to 24,000 accelerators" in scaled.source


def test_one_accelerator_cluster_mttf_is_the_accelerator_mttf() -> None:
    model = FailureModel.from_cluster_mttf(124 * 60.0, 24_000)
    assert model.accelerator_mttf_s == 124 * 60.0 * 24_000  # 49,600 h
    assert model.scaled_to(1).cluster_mttf_s == model.accelerator_mttf_s


@pytest.mark.parametrize(
    "call",
    [
        lambda: FailureModel.from_cluster_mttf(0.0, 8),
        lambda: FailureModel.from_cluster_mttf(-60.0, 8),
        lambda: FailureModel.from_accelerator_mttf(math.inf, 8),
        lambda: FailureModel.from_cluster_mttf(60.0, 0),
        lambda: FailureModel.from_record(interruptions=0, days=54, accelerators=16_384),
        lambda: FailureModel.from_record(interruptions=3, days=0, accelerators=16_384),
        lambda: Component(name="gpu", count=0, mttf_s=HOUR),
        lambda: Component(name="gpu", count=8, mttf_s=-HOUR),
        lambda: cluster_mttf_s([]),
        lambda: young_interval_s(2.0, 0.0),
        lambda: daly_interval_s(-1.0, HOUR),
    ],
)
def test_bad_failure_inputs_are_config_errors(call: Callable[[], object]) -> None:
    with pytest.raises(ConfigError):
        call()


# ---------------------------------------------------------------------------------------- Young and Daly


def test_young_interval() -> None:
    assert young_interval_s(2.0, HOUR) == 120.0  # sqrt(2 * 2 * 3600)
    assert young_interval_s(0.0, HOUR) == 0.0


def test_daly_interval_hand_value() -> None:
    # sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C with C/2M = 1/3600: 120 * (1 + 1/180 + 1/32400) - 2
    assert daly_interval_s(2.0, HOUR) == pytest.approx(118.670370, abs=1e-6)


@pytest.mark.parametrize("cost", [2 * HOUR, 3 * HOUR])
def test_daly_interval_is_mttf_once_cost_reaches_twice_mttf(cost: float) -> None:
    assert daly_interval_s(cost, HOUR) == HOUR


def _golden_max(f: Callable[[float], float], low: float, high: float) -> float:
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        low, high = (low, b) if f(a) > f(b) else (a, high)
    return (low + high) / 2


@pytest.mark.parametrize(("cost", "mttf"), [(30.0, 2 * HOUR), (300.0, HOUR), (600.0, HOUR)])
def test_daly_is_closer_than_young_to_the_exact_optimum(cost: float, mttf: float) -> None:
    exact = _golden_max(lambda tau: expected_goodput(tau, cost, mttf), 1.0, 5 * mttf)
    daly, young = daly_interval_s(cost, mttf), young_interval_s(cost, mttf)
    assert abs(daly - exact) < abs(young - exact)
    assert abs(daly - exact) / exact < 0.02


def test_goodput_hand_values() -> None:
    # tau / (M (exp((tau + C)/M) - 1)) with tau=120, C=2, M=3600
    assert expected_goodput(120.0, 2.0, HOUR) == pytest.approx(0.967034, abs=1e-6)
    # first order: 1 - C/(tau+C) - (tau+C)/2M = 0.966662
    assert expected_goodput(120.0, 2.0, HOUR) == pytest.approx(1 - 2 / 122 - 122 / 7200, abs=5e-4)
    # the restart time multiplies the segment by exp(R/M)
    assert expected_goodput(120.0, 2.0, HOUR, restart_s=600.0) == pytest.approx(
        0.967034 * math.exp(-600 / HOUR), abs=1e-6
    )


def test_goodput_edges() -> None:
    assert expected_goodput(0.0, 2.0, HOUR) == 0.0
    # a checkpoint costing twice the MTTF, interval M: 1 / (e^3 - 1)
    assert expected_goodput(HOUR, 2 * HOUR, HOUR) == pytest.approx(0.052396, abs=1e-6)
    assert expected_goodput(1e6 * HOUR, 0.0, HOUR) == 0.0  # exp overflows: the segment never completes
    with pytest.raises(ConfigError):
        expected_goodput(120.0, 2.0, HOUR, restart_s=-1.0)


# ------------------------------------------------------------------------------------------------- plans


def test_literature_example_24000_accelerators() -> None:
    failure = FailureModel.from_cluster_mttf(124 * 60.0, 24_000)
    plan = plan_interval(failure, checkpoints_per_mttf=20)
    assert plan.period_s == pytest.approx(372.0)  # 6.2 min
    assert plan.checkpoints_per_day == pytest.approx(232.26, abs=0.01)  # "about 233"
    assert plan.goodput is None  # no cost given
    assert plan.young_interval_s is None
    load = plan_bandwidth(LLAMA3_405B_12_BYTES, plan.period_s, 24_000)
    assert load.bytes_per_day / 1e15 == pytest.approx(1.131, abs=0.001)  # "about 1.1 PB a day"
    assert load.bytes_per_s / 1e9 == pytest.approx(13.09, abs=0.01)  # "about 13 GB/s"
    assert load.bytes_per_s_per_accelerator == pytest.approx(545_502, abs=1)
    assert [t.tier.name for t in load.tiers] == ["storage"]


def test_plan_interval_picks_daly_and_reports_both() -> None:
    failure = FailureModel.from_accelerator_mttf(HOUR, 1)
    plan = plan_interval(failure, cost_s=2.0, restart_s=600.0)
    assert plan.young_interval_s == 120.0
    assert plan.interval_s == pytest.approx(118.670370, abs=1e-6)
    assert plan.period_s == pytest.approx(120.670370, abs=1e-6)
    assert plan.chosen_by == "daly"
    young = plan_interval(failure, cost_s=2.0, formula="young")
    assert (young.interval_s, young.period_s) == (120.0, 122.0)
    assert young.goodput == pytest.approx(0.967034, abs=1e-6)


def test_plan_interval_with_cost_above_mttf() -> None:
    plan = plan_interval(FailureModel.from_cluster_mttf(HOUR, 8), cost_s=2 * HOUR)
    assert plan.interval_s == HOUR
    assert plan.period_s == 3 * HOUR
    assert plan.goodput == pytest.approx(0.052396, abs=1e-6)


def test_plan_interval_fixed_period_subtracts_the_cost() -> None:
    plan = plan_interval(FailureModel.from_cluster_mttf(HOUR, 8), cost_s=10.0, period_s=600.0)
    assert (plan.interval_s, plan.period_s, plan.chosen_by) == (590.0, 600.0, "fixed period")
    assert plan.checkpoints_per_mttf == 6.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs the checkpoint cost"),
        ({"cost_s": 0.0}, "cost of 0 s"),
        ({"period_s": 60.0, "checkpoints_per_mttf": 20}, "not both"),
        ({"cost_s": 60.0, "period_s": 60.0}, "does not fit in a period"),
        ({"checkpoints_per_mttf": 0}, "checkpoints per MTTF must be a positive"),
        ({"cost_s": 1.0, "formula": "newton"}, "unknown interval formula"),
    ],
)
def test_plan_interval_rejects(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_interval(FailureModel.from_cluster_mttf(HOUR, 8), **kwargs)  # type: ignore[arg-type]


def test_plan_bandwidth_per_tier() -> None:
    tiers = [
        TierSpec(name="memory", bandwidth_bytes_per_s=100e9),
        TierSpec(name="durable", bandwidth_bytes_per_s=2e9),
        TierSpec(name="durable5", every=5, bandwidth_bytes_per_s=2e9),
        TierSpec(name="unknown", every=2),
    ]
    load = plan_bandwidth(10**12, 100.0, 1000, tiers)
    memory, slow, widened, unknown = load.tiers
    assert (memory.drain_s, memory.keeps_up, memory.min_every) == (10.0, True, 1)
    assert memory.required_bytes_per_s == 1e10
    assert memory.required_bytes_per_s_per_accelerator == 1e7
    assert (slow.drain_s, slow.keeps_up, slow.min_every) == (500.0, False, 5)
    # every 5th checkpoint leaves 500 s for a 500 s drain: exactly keeps up
    assert (widened.keeps_up, widened.required_bytes_per_s, widened.checkpoints_per_day) == (True, 2e9, 172.8)
    assert (unknown.drain_s, unknown.keeps_up, unknown.min_every) == (None, None, None)
    assert unknown.bytes_per_day == 10**12 * 432


@pytest.mark.parametrize(
    ("drain", "period", "every"),
    [(0.0, 100.0, 1), (100.0, 100.0, 1), (100.001, 100.0, 2), (300.0, 100.0, 3), (0.1 * 3, 0.1, 3)],
)
def test_tier_every_for(drain: float, period: float, every: int) -> None:
    assert tier_every_for(drain, period) == every


def test_tier_every_for_rejects() -> None:
    with pytest.raises(ConfigError):
        tier_every_for(-1.0, 100.0)
    with pytest.raises(ConfigError):
        tier_every_for(1.0, 0.0)


# --------------------------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("600", 600.0),
        ("90s", 90.0),
        ("124min", 7440.0),
        ("6.2 min", 372.0),
        ("4h", 14_400.0),
        ("1h30m", 5400.0),
        ("2d", 172_800.0),
        ("250ms", 0.25),
        (45, 45.0),
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "h", "5 fortnights", "-3s", "1h30", "nan", "inf", True])
def test_parse_duration_rejects(text: object) -> None:
    with pytest.raises(ConfigError):
        parse_duration(text)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (45.0, "45 s"),
        (372.0, "6.2 min"),
        (7440.0, "124 min"),
        (4 * HOUR, "4 h"),
        (5 * 86_400, "5 d"),
        (49_600 * HOUR, "5.66 y"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


# ---------------------------------------------------------------------------------------------- policies


def _cost(step: int, wall_time: float, blocked_s: float = 2.0, drain_s: float = 0.0) -> SaveCost:
    return SaveCost(step=step, blocked_s=blocked_s, drain_s=drain_s, wall_time=wall_time)


def test_every_n_steps() -> None:
    policy: Schedule = EveryNSteps(interval_steps=100)
    assert [s for s in range(0, 401, 50) if policy.due(s, 0.0)] == [100, 200, 300, 400]
    policy.record(_cost(100, 0.0))  # stateless
    assert policy.due(200, 0.0)
    with pytest.raises(ConfigError):
        EveryNSteps(interval_steps=0)


def test_every_seconds_counts_from_training_start_then_from_each_save() -> None:
    policy = EverySeconds(600.0)
    assert not policy.due(1, now=1000.0)  # clock starts here
    assert not policy.due(2, now=1599.9)
    assert policy.due(3, now=1600.0)
    policy.record(_cost(3, wall_time=1600.5))
    assert not policy.due(4, now=2200.0)
    assert policy.due(5, now=2200.5)
    assert policy.tier_every(1500.0) == 3
    with pytest.raises(ConfigError):
        EverySeconds(0.0)


def _simulate(
    schedule: AutoSchedule,
    *,
    steps: int,
    step_s: float = 1.0,
    blocked_s: Callable[[int], float] = lambda i: 2.0,
    drain_s: float = 0.0,
) -> list[SaveCost]:
    """A training loop on a fake clock: each step takes step_s, each save blocks the loop for blocked_s(i)."""
    now, saves = 0.0, []
    for step in range(1, steps + 1):
        now += step_s
        if schedule.due(step, now):
            cost = _cost(step, now, blocked_s(len(saves)), drain_s)
            schedule.record(cost)
            saves.append(cost)
            now += cost.blocked_s
    return saves


def _compute_gaps(saves: list[SaveCost]) -> list[float]:
    """Compute time between saves: from the end of one save's blocking to the start of the next."""
    return [b.wall_time - (a.wall_time + a.blocked_s) for a, b in itertools.pairwise(saves)]


def test_auto_schedule_converges_to_young_interval() -> None:
    auto = AutoSchedule(mttf_s=HOUR, formula="young")
    # before any measurement: initial_cost_s=5 s -> sqrt(2 * 5 * 3600) = 189.7 s
    assert auto.interval_s == pytest.approx(189.74, abs=0.01)
    saves = _simulate(auto, steps=2000)
    assert saves[0].step == 191  # the first due() call, at t = 1 s, starts the clock
    assert auto.interval_s == 120.0  # sqrt(2 * 2 * 3600)
    assert set(_compute_gaps(saves)) == {120.0}
    assert auto.period_s == 122.0
    assert auto.expected_goodput == pytest.approx(0.967034, abs=1e-6)


def test_auto_schedule_daly_interval_on_step_granularity() -> None:
    auto = AutoSchedule(mttf_s=HOUR)
    saves = _simulate(auto, steps=2000)
    assert auto.interval_s == pytest.approx(118.670370, abs=1e-6)
    assert set(_compute_gaps(saves)) == {119.0}  # the first step at or after 118.67 s


def test_auto_schedule_smooths_towards_a_new_cost() -> None:
    auto = AutoSchedule(mttf_s=HOUR, formula="young", smoothing=0.3)
    intervals = []
    for i in range(25):
        auto.record(_cost(i, wall_time=1000.0 * i, blocked_s=20.0 if i == 0 else 2.0))
        intervals.append(auto.interval_s)
    assert intervals[0] == pytest.approx(math.sqrt(2 * 20 * HOUR))
    assert intervals == sorted(intervals, reverse=True)  # one slow save decays, never jumps back
    # after k saves at 2 s the average is 2 + 18 * 0.7**k
    assert auto.cost_s == pytest.approx(2 + 18 * 0.7**24)
    assert intervals[-1] == pytest.approx(120.0, rel=1e-3)


def test_auto_schedule_with_noisy_costs_averages_out() -> None:
    auto = AutoSchedule(mttf_s=HOUR, formula="young")
    saves = _simulate(auto, steps=20_000, blocked_s=lambda i: 1.0 if i % 2 else 3.0)
    gaps = _compute_gaps(saves)[10:]
    assert sum(gaps) / len(gaps) == pytest.approx(120.0, rel=0.03)
    assert min(gaps) >= 110.0
    assert max(gaps) <= 130.0


def test_auto_schedule_clamps_the_interval() -> None:
    fast = AutoSchedule(mttf_s=HOUR, formula="young", min_interval_s=30.0)
    fast.record(_cost(1, 0.0, blocked_s=0.001))  # sqrt(2 * 0.001 * 3600) = 2.7 s
    assert fast.interval_s == 30.0
    slow = AutoSchedule(mttf_s=HOUR)
    slow.record(_cost(1, 0.0, blocked_s=2.5 * HOUR))  # C >= 2M: Daly says M
    assert slow.interval_s == HOUR
    capped = AutoSchedule(mttf_s=HOUR, max_interval_s=60.0)
    capped.record(_cost(1, 0.0, blocked_s=2.0))
    assert capped.interval_s == 60.0


def _backlog(saves: list[SaveCost], every: int, drain_s: float) -> list[float]:
    """A tier that drains one checkpoint at a time: how long each sent checkpoint waits to start draining."""
    free_at, waits = 0.0, []
    for save in saves[::every]:
        start = max(free_at, save.wall_time)
        waits.append(start - save.wall_time)
        free_at = start + drain_s
    return waits


def test_auto_schedule_widens_a_slow_tier_just_enough() -> None:
    auto = AutoSchedule(mttf_s=HOUR, formula="young")
    saves = _simulate(auto, steps=6000, drain_s=300.0)
    assert auto.drain_s == 300.0
    every = auto.tier_every(auto.drain_s)
    assert every == 3  # period 122 s: 2 x 122 = 244 < 300 <= 366 = 3 x 122
    steady = saves[1:]  # after the first (initial-estimate) interval the period is 122 s
    assert max(_backlog(steady, every, 300.0)) == 0.0  # every 3rd checkpoint: the tier keeps up
    waits = _backlog(steady, every - 1, 300.0)
    assert waits[-1] > waits[10] > 0.0  # every 2nd: the backlog grows without bound
    assert auto.tier_every(0.0) == 1
    assert auto.tier_every(122.0) == 1
    assert auto.tier_every(122.5) == 2
    with pytest.raises(ConfigError):
        auto.tier_every(-1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mttf_s": 0.0}, "mttf_s must be a positive"),
        ({"mttf_s": HOUR, "restart_s": -1.0}, "restart_s must be a finite number >= 0"),
        ({"mttf_s": HOUR, "min_interval_s": 600.0, "max_interval_s": 60.0}, "exceeds max_interval_s"),
        ({"mttf_s": HOUR, "smoothing": 0.0}, "smoothing must be in"),
        ({"mttf_s": HOUR, "smoothing": 1.5}, "smoothing must be in"),
        ({"mttf_s": HOUR, "formula": "guess"}, "unknown interval formula"),
    ],
)
def test_auto_schedule_rejects(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AutoSchedule(**kwargs)  # type: ignore[arg-type]


def test_save_cost_validates() -> None:
    with pytest.raises(ConfigError):
        SaveCost(step=1, blocked_s=-0.1, drain_s=0.0, wall_time=0.0)
    with pytest.raises(ConfigError):
        SaveCost(step=-1, blocked_s=0.1, drain_s=0.0, wall_time=0.0)
    with pytest.raises(ConfigError):
        SaveCost(step=1, blocked_s=0.1, drain_s=math.nan, wall_time=0.0)


# ----------------------------------------------------------------------------------------- parse_schedule


def test_parse_schedule_forms() -> None:
    assert parse_schedule(None) is None
    assert parse_schedule(100) == EveryNSteps(interval_steps=100)
    assert parse_schedule("steps:250") == EveryNSteps(interval_steps=250)
    seconds = parse_schedule("seconds:10min")
    assert isinstance(seconds, EverySeconds)
    assert seconds.interval_s == 600.0
    floats = parse_schedule(90.0)
    assert isinstance(floats, EverySeconds)
    assert floats.interval_s == 90.0
    auto = parse_schedule("auto:mttf=4h")
    assert isinstance(auto, AutoSchedule)
    assert (auto.mttf_s, auto.restart_s, auto.formula.value) == (4 * HOUR, 0.0, "daly")
    full = parse_schedule("auto: mttf=2h, restart=10min, min=1min, max=1h, formula=young, smoothing=0.5")
    assert isinstance(full, AutoSchedule)
    assert (full.mttf_s, full.restart_s, full.min_interval_s, full.max_interval_s) == (7200.0, 600.0, 60.0, HOUR)
    assert (full.formula.value, full.smoothing) == ("young", 0.5)
    custom = EverySeconds(5.0)
    assert parse_schedule(custom) is custom


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("auto:restart=5min", "auto needs the cluster MTTF"),
        ("auto:mttf=0", "mttf_s must be a positive"),
        ("auto:mttf=4h,every=3", "unknown option 'every'"),
        ("steps:abc", "step count must be an integer"),
        ("steps:0", "interval_steps must be a positive integer"),
        ("hourly", "must be one of 'steps:N'"),
        ("weekly:3", "unknown schedule kind 'weekly'"),
        (True, "must be one of"),
        (object(), "must be a Schedule"),
    ],
)
def test_parse_schedule_rejects(spec: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_schedule(spec)  # type: ignore[arg-type]


def test_docstring_examples_run() -> None:
    from tiersave.planner import bandwidth, failures, interval, schedule

    results = [doctest.testmod(module) for module in (failures, interval, bandwidth, schedule)]
    assert sum(r.attempted for r in results) >= 8
    assert sum(r.failed for r in results) == 0
