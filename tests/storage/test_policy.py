"""Retention policies as pure logic: keep-last, milestones, best-by-metric with ties, tags, union, and the
protection rules that always win (newest verified durable, steps being read)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from tiersave.errors import ConfigError
from tiersave.policy import (
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepTagged,
    RetentionPolicy,
    format_policy,
    parse_policy,
    plan_retention,
)


@dataclass(frozen=True)
class Info:
    step: int
    metrics: dict = field(default_factory=dict)
    tags: tuple = ()
    created_at: str = "2026-01-01T00:00:00.000000Z"


def infos(steps, **per_step):
    return [
        Info(s, metrics=per_step.get("metrics", {}).get(s, {}), tags=per_step.get("tags", {}).get(s, ())) for s in steps
    ]


def test_keep_last():
    cps = infos(range(1, 6))
    assert KeepLast(2).keep(cps) == {4, 5}
    assert KeepLast(10).keep(cps) == {1, 2, 3, 4, 5}
    assert KeepLast(1).keep([]) == frozenset()


def test_keep_every_aligned_and_unaligned_saves():
    assert KeepEvery(1000).keep(infos(range(0, 5001, 500))) == {0, 1000, 2000, 3000, 4000, 5000}
    # saves every 300 steps, milestones every 1000: the first save in each window, stable as more arrive
    first = KeepEvery(1000).keep(infos(range(300, 3001, 300)))
    assert first == {300, 1200, 2100, 3000}
    assert KeepEvery(1000).keep(infos(range(300, 6001, 300))) >= first


def test_keep_best_min_max_and_ties_prefer_newer():
    metrics = {1: {"loss": 0.5}, 2: {"loss": 0.3}, 3: {"loss": 0.3}, 4: {"loss": 0.9}, 5: {"loss": 0.3}, 6: {}}
    cps = infos(range(1, 7), metrics=metrics)
    assert KeepBest(1, "loss").keep(cps) == {5}  # three-way tie at 0.3: the newest wins
    assert KeepBest(2, "loss", "min").keep(cps) == {3, 5}
    assert KeepBest(1, "loss", "max").keep(cps) == {4}
    assert KeepBest(10, "loss").keep(cps) == {1, 2, 3, 4, 5}  # step 6 lacks the metric: never a candidate
    assert KeepBest(1, "accuracy").keep(cps) == frozenset()


def test_keep_best_ignores_non_finite_and_bool():
    cps = infos([1, 2, 3], metrics={1: {"loss": float("nan")}, 2: {"loss": True}, 3: {"loss": 2.0}})
    assert KeepBest(1, "loss").keep(cps) == {3}
    assert KeepBest(3, "loss").ranked(cps) == [(2.0, 3)]


def test_keep_tagged_and_union():
    cps = infos(range(1, 8), tags={2: ("milestone",), 3: ("best", "x"), 6: ("other",)})
    assert KeepTagged(("milestone", "best")).keep(cps) == {2, 3}
    union = KeepLast(1) | KeepTagged(("milestone",)) | KeepEvery(4)
    assert isinstance(union, KeepAny) and len(union.policies) == 3
    assert union.keep(cps) == {7, 2, 1, 4}
    assert KeepAny().keep(cps) == {1, 2, 3, 4, 5, 6, 7}  # no parts: keep everything


def test_plan_protects_newest_verified_durable():
    cps = infos(range(1, 11), metrics={s: {"loss": float(s)} for s in range(1, 11)})
    # The policy keeps only the best (oldest) one; the newest (verified) one survives anyway.
    plan = plan_retention(cps, KeepBest(1, "loss"))
    assert plan.keep == (1, 10) and plan.delete == tuple(range(2, 10))
    assert plan.reasons[10] == ("newest verified durable",) and plan.reasons[1] == ("best=1:loss:min",)
    # Only 5 and 6 are verified durable (7..10 still draining): 6 is protected even though newer ones exist.
    plan = plan_retention(cps, KeepLast(2), verified={5, 6})
    assert plan.keep == (6, 9, 10)
    # A verified set that names no listed step protects nothing extra.
    assert plan_retention(cps, KeepLast(1), verified={99}).keep == (10,)


def test_plan_protected_steps_always_kept():
    cps = infos(range(1, 6))
    plan = plan_retention(cps, KeepLast(1), protected={2, 42})
    assert plan.keep == (2, 5) and plan.delete == (1, 3, 4)
    assert "protected" in plan.reasons[2]


def test_plan_never_empties_a_tier_and_is_deterministic():
    rng = random.Random(7)
    steps = rng.sample(range(1, 10_000), 200)
    metrics = {s: {"loss": rng.choice([0.1, 0.2, 0.3])} for s in steps}
    tags = {s: ("milestone",) for s in rng.sample(steps, 5)}
    cps = infos(steps, metrics=metrics, tags=tags)
    policy = parse_policy("last=3,every=1000,best=2:loss:min,tag=milestone")
    plan = plan_retention(cps, policy, protected={steps[0]})
    shuffled = list(cps)
    rng.shuffle(shuffled)
    assert plan_retention(shuffled, policy, protected={steps[0]}) == plan
    assert set(plan.keep) | set(plan.delete) == set(steps) and not set(plan.keep) & set(plan.delete)
    assert max(steps) in plan.keep and steps[0] in plan.keep
    assert all(s in plan.keep for s in tags)
    best = sorted(steps, key=lambda s: (metrics[s]["loss"], -s))[:2]
    assert all(s in plan.keep for s in best)
    for policy_one in (KeepLast(1), KeepBest(1, "nope"), KeepTagged(("absent",))):
        assert plan_retention(cps, policy_one).keep  # something always survives
    assert plan_retention([], KeepLast(1)).keep == ()


def test_duplicate_steps_count_once():
    plan = plan_retention([Info(3), Info(3), Info(1)], KeepLast(1))
    assert plan.keep == (3,) and plan.delete == (1,)


def test_parse_policy_and_round_trip():
    policy = parse_policy(" last=3 , every=1000,best=2:loss:min,tag=milestone,tag=best ")
    assert policy == KeepAny(
        (KeepLast(3), KeepEvery(1000), KeepBest(2, "loss", "min"), KeepTagged(("milestone", "best")))
    )
    assert parse_policy("best=1:acc:max").policies == (KeepBest(1, "acc", "max"),)
    assert parse_policy("best=1:loss").policies == (KeepBest(1, "loss", "min"),)
    assert parse_policy("tag=a+b").policies == (KeepTagged(("a", "b")),)
    text = format_policy(policy)
    assert text == "last=3,every=1000,best=2:loss:min,tag=milestone,tag=best"
    assert parse_policy(text) == policy
    assert isinstance(policy, RetentionPolicy)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "last",
        "last=0",
        "last=-1",
        "last=x",
        "every=0",
        "best=2",
        "best=2:loss:median",
        "best=0:loss",
        "best=1::min",
        "tag=",
        "tag=../x",
        "keep=3",
        "last=3,,every=2",
    ],
)
def test_parse_policy_rejects(spec):
    with pytest.raises(ConfigError):
        parse_policy(spec)


def test_constructors_validate():
    for bad in (
        lambda: KeepLast(0),
        lambda: KeepLast(True),
        lambda: KeepEvery(0),
        lambda: KeepBest(1, "loss", "avg"),
        lambda: KeepTagged(()),
        lambda: KeepTagged("milestone"),
        lambda: KeepAny((object(),)),
    ):
        with pytest.raises(ConfigError):
            bad()
