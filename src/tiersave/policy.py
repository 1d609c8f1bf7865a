"""Retention policies: which checkpoints of one tier to keep, as pure logic over their descriptions.

Scope: small frozen dataclasses (orbax ``preservation_policy`` style) that look at a list of checkpoint
infos (step, created_at, metrics, tags) and name the steps they keep, a union of them, the protection
rules that always win, and a parser for the CLI spec. Anti-scope: listing and deleting (the caller does it
with ``Catalog``), when to save (``tiersave.planner.schedule``), torch.

Example::

    policy = parse_policy("last=3,every=1000,best=2:loss:min,tag=milestone")
    plan = plan_retention(catalog.infos(), policy, protected={step_being_read})
    for step in plan.delete:
        catalog.delete(step)

Rules:

- A policy keeps the union of what its parts keep: ``KeepLast(3) | KeepBest(1, "loss")``.
- :func:`plan_retention` never deletes a step in ``protected`` (a reader has it open) nor the newest
  checkpoint verified durable on the tier, whatever the policy says. With no policy parts at all, nothing
  is deleted.
- Every decision is deterministic: the same infos give the same plan (ties are broken by step).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from .errors import ConfigError

__all__ = [
    "CheckpointLike",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepTagged",
    "RetentionPlan",
    "RetentionPolicy",
    "format_policy",
    "parse_policy",
    "plan_retention",
]

_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_METRIC_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,127}$")


@runtime_checkable
class CheckpointLike(Protocol):
    """What a policy reads of a checkpoint; ``tiersave.catalog.CheckpointInfo`` has it."""

    @property
    def step(self) -> int: ...

    @property
    def created_at(self) -> str: ...

    @property
    def metrics(self) -> Mapping[str, float]: ...

    @property
    def tags(self) -> Sequence[str]: ...


@runtime_checkable
class RetentionPolicy(Protocol):
    """Names the steps it keeps. Pure: no I/O, no state; the same input gives the same output."""

    def keep(self, checkpoints: Sequence[CheckpointLike]) -> frozenset[int]:
        """The steps among ``checkpoints`` this policy keeps (the rest it would let go)."""
        ...


class _Combinable:
    """``a | b``: keep what either keeps."""

    def __or__(self, other: RetentionPolicy) -> KeepAny:
        return KeepAny(_parts(self) + _parts(other))


def _parts(policy: object) -> tuple[RetentionPolicy, ...]:
    if isinstance(policy, KeepAny):
        return policy.policies
    if not isinstance(policy, RetentionPolicy):
        raise ConfigError(f"{policy!r} is not a retention policy")
    return (policy,)


@dataclass(frozen=True)
class KeepLast(_Combinable):
    """Keep the ``n`` newest checkpoints (by step).

    Attributes:
        n: how many, >= 1.
    """

    n: int

    def __post_init__(self) -> None:
        _positive(self.n, "KeepLast.n")

    def keep(self, checkpoints: Sequence[CheckpointLike]) -> frozenset[int]:
        return frozenset(sorted({c.step for c in checkpoints})[-self.n :])

    def __str__(self) -> str:
        return f"last={self.n}"


@dataclass(frozen=True)
class KeepEvery(_Combinable):
    """Keep milestones: the oldest checkpoint in each window ``[k * interval_steps, (k + 1) * interval_steps)``.

    With saves on multiples of the interval this keeps exactly the steps divisible by it; with saves that
    do not land on multiples (every 300 steps, milestones every 1000) it still keeps one per window, the
    first one saved, and that choice never changes as later checkpoints arrive.

    Attributes:
        interval_steps: window width in steps, >= 1.
    """

    interval_steps: int

    def __post_init__(self) -> None:
        _positive(self.interval_steps, "KeepEvery.interval_steps")

    def keep(self, checkpoints: Sequence[CheckpointLike]) -> frozenset[int]:
        first: dict[int, int] = {}
        for c in checkpoints:
            window = c.step // self.interval_steps
            if window not in first or c.step < first[window]:
                first[window] = c.step
        return frozenset(first.values())

    def __str__(self) -> str:
        return f"every={self.interval_steps}"


@dataclass(frozen=True)
class KeepBest(_Combinable):
    """Keep the ``n`` best checkpoints by a metric.

    Checkpoints without the metric (or with a non-finite value) are not candidates. Ties are broken
    deterministically in favour of the newer step (more training behind it, and it is the one a user
    resuming "the best" would expect).

    Attributes:
        n: how many, >= 1.
        metric: the metric's name, as passed to ``save(metrics=...)``.
        mode: ``"min"`` (loss) or ``"max"`` (accuracy).
    """

    n: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        _positive(self.n, "KeepBest.n")
        if not isinstance(self.metric, str) or not _METRIC_RE.match(self.metric):
            raise ConfigError(f"KeepBest.metric must be a metric name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"KeepBest.mode must be 'min' or 'max', got {self.mode!r}")

    def ranked(self, checkpoints: Sequence[CheckpointLike]) -> list[tuple[float, int]]:
        """``(value, step)`` of every candidate, best first."""
        scored = []
        for c in checkpoints:
            value = c.metrics.get(self.metric)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            scored.append((float(value), c.step))
        sign = 1.0 if self.mode == "min" else -1.0
        return sorted(scored, key=lambda vs: (sign * vs[0], -vs[1]))

    def keep(self, checkpoints: Sequence[CheckpointLike]) -> frozenset[int]:
        return frozenset(step for _, step in self.ranked(checkpoints)[: self.n])

    def __str__(self) -> str:
        return f"best={self.n}:{self.metric}:{self.mode}"


@dataclass(frozen=True)
class KeepTagged(_Combinable):
    """Keep every checkpoint carrying at least one of ``tags``.

    Attributes:
        tags: tag names (``"milestone"``, ``"best"``...).
    """

    tags: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.tags, str) or not self.tags:
            raise ConfigError(f"KeepTagged.tags must be a non-empty tuple of tags, got {self.tags!r}")
        for tag in self.tags:
            if not isinstance(tag, str) or not _TAG_RE.match(tag):
                raise ConfigError(f"KeepTagged: {tag!r} is not a valid tag")
        object.__setattr__(self, "tags", tuple(dict.fromkeys(self.tags)))

    def keep(self, checkpoints: Sequence[CheckpointLike]) -> frozenset[int]:
        wanted = set(self.tags)
        return frozenset(c.step for c in checkpoints if wanted.intersection(c.tags))

    def __str__(self) -> str:
        return ",".join(f"tag={t}" for t in self.tags)


@dataclass(frozen=True)
class KeepAny(_Combinable):
    """Keep what any of ``policies`` keeps (orbax ``AnyPreservationPolicy``). Empty: keep everything.

    Attributes:
        policies: the parts.
    """

    policies: tuple[RetentionPolicy, ...] = field(default=())

    def __post_init__(self) -> None:
        for p in self.policies:
            if not isinstance(p, RetentionPolicy):
                raise ConfigError(f"KeepAny: {p!r} is not a retention policy")

    def keep(self, checkpoints: Sequence[CheckpointLike]) -> frozenset[int]:
        if not self.policies:
            return frozenset(c.step for c in checkpoints)
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(checkpoints)
        return frozenset(kept)

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.policies) or "all"


@dataclass(frozen=True)
class RetentionPlan:
    """The outcome of :func:`plan_retention`.

    Attributes:
        keep: steps kept, ascending.
        delete: steps to delete, ascending (oldest first: delete in this order).
        reasons: for each kept step, why (``"last=3"``, ``"protected: being read"``...).
    """

    keep: tuple[int, ...]
    delete: tuple[int, ...]
    reasons: Mapping[int, tuple[str, ...]]

    def to_json(self) -> dict[str, object]:
        return {
            "keep": list(self.keep),
            "delete": list(self.delete),
            "reasons": {str(k): list(v) for k, v in sorted(self.reasons.items())},
        }


def plan_retention(
    checkpoints: Iterable[CheckpointLike],
    policy: RetentionPolicy,
    *,
    protected: Collection[int] = (),
    verified: Collection[int] | None = None,
) -> RetentionPlan:
    """Decide which checkpoints of one tier to delete.

    Protection always wins over the policy: a step in ``protected`` is kept, and so is the newest step
    that is verified durable on this tier.

    Args:
        checkpoints: the tier's committed checkpoints (any order; duplicate steps count once).
        policy: what to keep.
        protected: steps that must survive (open by a reader, being copied, pinned by the user).
        verified: steps known complete and durable on this tier (committed and acknowledged, or
            verified after a copy). None means every listed checkpoint (they are committed). Only the
            newest of these is protected, so retention can never leave the tier without its last good
            checkpoint, even when the policy would keep only newer, unverified ones.

    Returns:
        The plan; nothing is deleted by this function.
    """
    infos = {c.step: c for c in checkpoints}
    ordered = [infos[s] for s in sorted(infos)]
    reasons: dict[int, list[str]] = {}
    parts = policy.policies if isinstance(policy, KeepAny) and policy.policies else (policy,)
    for part in parts:
        for step in part.keep(ordered):
            if step in infos:
                reasons.setdefault(step, []).append(str(part))
    for step in protected:
        if step in infos:
            reasons.setdefault(step, []).append("protected")
    durable = set(infos) if verified is None else set(verified) & set(infos)
    if durable:
        reasons.setdefault(max(durable), []).append("newest verified durable")
    keep = tuple(sorted(reasons))
    delete = tuple(s for s in sorted(infos) if s not in reasons)
    return RetentionPlan(keep, delete, {s: tuple(r) for s, r in reasons.items()})


def parse_policy(spec: str) -> KeepAny:
    """Parse a CLI retention spec: comma-separated parts, each kept checkpoint kept by any part.

    Parts: ``last=N``, ``every=K`` (milestone windows of K steps), ``best=N:METRIC[:min|max]`` (default
    min), ``tag=NAME`` (repeatable; ``tag=a+b`` also works). Example:
    ``"last=3,every=1000,best=2:loss:min,tag=milestone"``.

    Raises:
        ConfigError: an unknown part, a bad number, metric or tag; the message shows the accepted form.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("empty retention policy; example: last=3,every=1000,best=2:loss:min,tag=milestone")
    parts: list[RetentionPolicy] = []
    tags: list[str] = []
    for raw in spec.split(","):
        item = raw.strip()
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            raise ConfigError(f"retention part {item!r} must look like name=value ({_FORMS})")
        if key == "last":
            parts.append(KeepLast(_int(value, item)))
        elif key == "every":
            parts.append(KeepEvery(_int(value, item)))
        elif key == "best":
            fields_ = value.split(":")
            if len(fields_) not in (2, 3):
                raise ConfigError(f"retention part {item!r} must be best=N:METRIC[:min|max]")
            mode = fields_[2].lower() if len(fields_) == 3 else "min"
            if mode not in ("min", "max"):
                raise ConfigError(f"retention part {item!r}: the mode must be min or max")
            parts.append(KeepBest(_int(fields_[0], item), fields_[1], "min" if mode == "min" else "max"))
        elif key in ("tag", "tags"):
            tags.extend(t for t in value.split("+"))
        else:
            raise ConfigError(f"unknown retention part {key!r} in {spec!r} ({_FORMS})")
    if tags:
        parts.append(KeepTagged(tuple(tags)))
    return KeepAny(tuple(parts))


def format_policy(policy: RetentionPolicy) -> str:
    """The spec string that :func:`parse_policy` reads back to an equal policy (for display and logs)."""
    return str(policy)


_FORMS = "last=N, every=K, best=N:METRIC[:min|max], tag=NAME"


def _int(text: str, item: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"retention part {item!r}: {text!r} is not an integer") from None
    if value < 1:
        raise ConfigError(f"retention part {item!r}: must be at least 1")
    return value


def _positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
