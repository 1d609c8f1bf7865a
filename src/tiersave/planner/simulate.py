"""The goodput simulator: a discrete-event model of a long job under failures, one strategy at a time.

Scope: failure traces (exponential by default, Weibull, or a replayed list of times; each failure a
process crash or a node loss) (:class:`FailureSpec`, :func:`failure_trace`); the run of one checkpointing
strategy (:class:`Strategy`, its tiers :class:`SimTier`) over one trace (:func:`run_trace`), which tallies
useful compute, re-computation, blocked saves, restarts and bytes per tier; the comparison of strategies
on the SAME traces with a 95% interval over repeated traces (:func:`compare`).

The model, per strategy: training computes for ``interval_s``, then a save blocks it for ``blocked_s``
(after waiting for the first tier's previous write, whose staging buffer the save reuses); the first
tier then holds the checkpoint after ``write_s``, and every ``every``-th checkpoint drains from it to each
later tier in the background (a tier still busy defers it, and catches up on the newest deferred one when
idle, as :class:`tiersave.tiers.TierChain` does). A failure aborts whatever is in flight; a node loss also
empties the tiers that live on the nodes (memory, local disk). The restart takes ``reschedule_s`` plus the
read of the newest usable checkpoint from the fastest tier holding it, and may itself be interrupted.
Between failures the dynamics are periodic: the run jumps over whole repeating cycles, exactly, so a
thousand days take well under a second per strategy.

Anti-scope: choosing the strategies from a job's description (:mod:`tiersave.planner.simulate_strategies`),
the analytic formulas (:mod:`tiersave.planner.interval`), any I/O, clock or plotting.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..units import SECONDS_PER_DAY
from ._checks import require_count, require_non_negative, require_positive

__all__ = [
    "CRASH",
    "NODE_LOSS",
    "Comparison",
    "FailureSpec",
    "SimTier",
    "Strategy",
    "StrategyResult",
    "Tally",
    "compare",
    "failure_trace",
    "run_trace",
]

CRASH = 0
"""A failure that kills the training processes; the nodes and what their memory holds survive."""
NODE_LOSS = 1
"""A failure that takes a node away: its memory and local disk are gone."""

_INF = math.inf
# Offsets are compared to this many decimals when looking for a repeating cycle: two float computations
# of the same cycle differ in the last bits only.
_DIGITS = 6


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureSpec:
    """How failures arrive.

    Attributes:
        mttf_s: the job's mean time between failures (cluster MTTF), for drawn traces.
        weibull_shape: ``None`` for exponential inter-arrival times; else the Weibull shape ``k``
            (``k < 1``: failures cluster, infant mortality; ``k > 1``: wear-out), scaled so the mean is
            ``mttf_s``.
        node_loss_share: the fraction of failures that lose a node (the rest are process crashes).
        replay: fixed failure times in seconds from the start; replaces the drawn times (their kinds are
            still drawn unless ``replay_kinds`` gives them).
        replay_kinds: :data:`CRASH` or :data:`NODE_LOSS` per replayed time.
    """

    mttf_s: float
    weibull_shape: float | None = None
    node_loss_share: float = 0.5
    replay: tuple[float, ...] | None = None
    replay_kinds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        require_positive("MTTF", self.mttf_s)
        if self.weibull_shape is not None:
            require_positive("Weibull shape", self.weibull_shape)
        share = self.node_loss_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ConfigError(f"the node-loss share must be a number in [0, 1], got {share!r}")
        if self.replay is not None:
            for t in self.replay:
                require_non_negative("replayed failure time", t)
            if list(self.replay) != sorted(self.replay):
                raise ConfigError("replayed failure times must be in increasing order")
            if self.replay_kinds is not None and len(self.replay_kinds) != len(self.replay):
                raise ConfigError("give one kind per replayed failure time")

    def describe(self) -> str:
        """One line for reports."""
        if self.replay is not None:
            law = f"{len(self.replay):,} replayed failure times"
        elif self.weibull_shape is None:
            law = "exponential inter-arrival times"
        else:
            law = f"Weibull inter-arrival times (shape {self.weibull_shape:g})"
        return f"{law}; {self.node_loss_share:.0%} of failures lose a node, the rest are process crashes"


def failure_trace(spec: FailureSpec, horizon_s: float, rng: random.Random) -> tuple[list[float], list[int]]:
    """Failure times (increasing, below ``horizon_s``) and their kinds, drawn with ``rng``.

    Inter-arrival times are drawn for the whole job (a renewal process: every failure restarts the
    clock of the next), exponential or Weibull with mean ``spec.mttf_s``.
    """
    times: list[float] = []
    if spec.replay is not None:
        times = [t for t in spec.replay if t < horizon_s]
    elif spec.weibull_shape is None:
        rate = 1.0 / spec.mttf_s
        t = rng.expovariate(rate)
        while t < horizon_s:
            times.append(t)
            t += rng.expovariate(rate)
    else:
        shape = spec.weibull_shape
        scale = spec.mttf_s / math.gamma(1.0 + 1.0 / shape)
        t = rng.weibullvariate(scale, shape)
        while t < horizon_s:
            times.append(t)
            t += rng.weibullvariate(scale, shape)
    if spec.replay is not None and spec.replay_kinds is not None:
        kinds = list(spec.replay_kinds[: len(times)])
    else:
        share = spec.node_loss_share
        kinds = [NODE_LOSS if rng.random() < share else CRASH for _ in times]
    return times, kinds


@dataclass(frozen=True, kw_only=True, slots=True)
class SimTier:
    """A storage tier as the simulator sees it.

    Attributes:
        name: for reports.
        write_s: time to write one checkpoint to it once the previous tier holds it (for the first tier:
            once the save stops blocking; 0 when the blocking part is the write).
        restore_s: time to read one checkpoint back on a restart.
        every: later tiers receive every ``every``-th checkpoint.
        survives_crash: whether what it holds outlives a process crash.
        survives_node_loss: whether what it holds outlives the loss of a node (durable storage, a peer
            replica on another node).
        bytes_per_write: bytes one checkpoint puts on it, for the totals.
    """

    name: str
    write_s: float = 0.0
    restore_s: float = 0.0
    every: int = 1
    survives_crash: bool = True
    survives_node_loss: bool = True
    bytes_per_write: int = 0

    def __post_init__(self) -> None:
        require_non_negative(f"tier {self.name!r}: write time", self.write_s)
        require_non_negative(f"tier {self.name!r}: restore time", self.restore_s)
        require_count(f"tier {self.name!r}: every", self.every)


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """One way of checkpointing a job.

    Attributes:
        name: e.g. ``"fixed"``, ``"tiered"``.
        interval_s: compute time between the end of one save's blocking part and the next save.
        blocked_s: time each save blocks training (the whole write for a synchronous save, the staging
            copy for an asynchronous one).
        tiers: the first tier, then the tiers it drains to.
        reschedule_s: time from a failure until the job can start reading a checkpoint.
        description: how the figures were chosen, for reports.
    """

    name: str
    interval_s: float
    blocked_s: float
    tiers: tuple[SimTier, ...]
    reschedule_s: float = 0.0
    description: str = ""

    def __post_init__(self) -> None:
        require_positive(f"strategy {self.name!r}: interval", self.interval_s)
        require_non_negative(f"strategy {self.name!r}: blocked time", self.blocked_s)
        require_non_negative(f"strategy {self.name!r}: reschedule time", self.reschedule_s)
        if not self.tiers:
            raise ConfigError(f"strategy {self.name!r} needs at least one tier")


@dataclass(slots=True)
class Tally:
    """Where the wall time of one run went, and what it wrote.

    ``wall_s == useful_s + recompute_s + blocked_s + restart_s`` (up to rounding): compute that was
    later lost counts as re-computation, not as useful.
    """

    wall_s: float = 0.0
    useful_s: float = 0.0
    recompute_s: float = 0.0
    blocked_s: float = 0.0
    restart_s: float = 0.0
    failures: int = 0
    saves: int = 0
    bytes_by_tier: list[float] = field(default_factory=list)
    restores_by_tier: list[int] = field(default_factory=list)
    restarts_from_scratch: int = 0

    @property
    def goodput(self) -> float:
        """Useful compute over wall time."""
        return self.useful_s / self.wall_s if self.wall_s > 0 else 0.0


def run_trace(strategy: Strategy, times: Sequence[float], kinds: Sequence[int], horizon_s: float) -> Tally:
    """Run ``strategy`` for ``horizon_s`` seconds of wall time through the failures ``times``/``kinds``.

    Raises:
        ConfigError: a non-positive horizon, or not one kind per failure time.
    """
    horizon = require_positive("simulated time", horizon_s)
    if len(times) != len(kinds):
        raise ConfigError(f"give one kind per failure time: {len(times)} times, {len(kinds)} kinds")
    return _Run(strategy, horizon).run(times, kinds)


class _Run:
    """The state of one strategy's run; the hot loop keeps it in local variables."""

    def __init__(self, s: Strategy, horizon: float) -> None:
        self.s = s
        self.horizon = horizon
        n = len(s.tiers)
        self.held: list[float | None] = [None] * n  # newest position (compute seconds) each tier holds
        self.busy_until = [-_INF] * n
        self.busy_start = [0.0] * n
        self.inflight: list[float | None] = [None] * n
        self.behind: list[float | None] = [None] * n
        self.tally = Tally(bytes_by_tier=[0.0] * n, restores_by_tier=[0] * n)

    # Drains are settled lazily: whenever the run needs a tier's state at time `upto`, the writes that
    # finished by then are recorded, and a deferred (newest) save starts where the previous write ended.
    def settle(self, k: int, upto: float) -> None:
        tier = self.s.tiers[k]
        while self.inflight[k] is not None and self.busy_until[k] <= upto:
            self.held[k] = self.inflight[k]
            self.tally.bytes_by_tier[k] += tier.bytes_per_write
            self.inflight[k] = None
            if self.behind[k] is not None:
                self.inflight[k], self.behind[k] = self.behind[k], None
                self.busy_start[k] = self.busy_until[k]
                self.busy_until[k] += tier.write_s

    def start_write(self, k: int, position: float, at: float) -> None:
        """Tier ``k`` receives the checkpoint at ``position``, available to copy from ``at``."""
        self.settle(k, at)
        if self.inflight[k] is not None:
            self.behind[k] = position  # a newer deferred save replaces an older one
            return
        self.inflight[k] = position
        self.busy_start[k] = at
        self.busy_until[k] = at + self.s.tiers[k].write_s
        if self.s.tiers[k].write_s == 0.0:
            self.settle(k, at)

    def fail(self, at: float, kind: int) -> None:
        """Abort what is in flight at ``at``; a node loss empties the tiers on the nodes."""
        t = self.tally
        t.failures += 1
        for k, tier in enumerate(self.s.tiers):
            self.settle(k, at)
            if self.inflight[k] is not None and tier.write_s > 0:
                done = (at - self.busy_start[k]) / tier.write_s
                t.bytes_by_tier[k] += tier.bytes_per_write * min(1.0, max(0.0, done))
            self.inflight[k] = self.behind[k] = None
            self.busy_until[k] = -_INF
            if not (tier.survives_node_loss if kind == NODE_LOSS else tier.survives_crash):
                self.held[k] = None

    def restore_choice(self) -> tuple[float, float, int]:
        """(position, read time, tier index or -1): the newest usable checkpoint, from its fastest tier."""
        best, read, index = 0.0, 0.0, -1
        for k, tier in enumerate(self.s.tiers):
            p = self.held[k]
            if p is None:
                continue
            if index < 0 or p > best or (p == best and tier.restore_s < read):
                best, read, index = p, tier.restore_s, k
        return best, read, index

    def signature(self, t: float, work: float) -> tuple[object, ...]:
        """The state relative to (t, work): equal signatures a cycle apart mean the cycle repeats."""
        out: list[object] = []
        for k in range(len(self.s.tiers)):
            h, f, b = self.held[k], self.inflight[k], self.behind[k]
            out.append(None if h is None else round(work - h, _DIGITS))
            out.append(None if f is None else round(work - f, _DIGITS))
            out.append(None if b is None else round(work - b, _DIGITS))
            out.append(None if f is None else round(self.busy_until[k] - t, _DIGITS))
        return tuple(out)

    def run(self, times: Sequence[float], kinds: Sequence[int]) -> Tally:
        s, tally, horizon = self.s, self.tally, self.horizon
        tiers = s.tiers
        first = tiers[0]
        later = [(k, tier.every) for k, tier in enumerate(tiers) if k > 0]
        cycle = 1
        for _, every in later:
            cycle = cycle * every // math.gcd(cycle, every)
        # a jump needs two equal cycles behind it and leaves two ahead: not worth looking for in less
        span = 5.0 * cycle * (s.interval_s + s.blocked_s)
        interval, blocked_s = s.interval_s, s.blocked_s
        t = work = 0.0
        computed = blocked = restarting = 0.0
        saves = 0
        fi, nf = 0, len(times)
        next_fail = times[0] if nf else _INF
        last_sig: tuple[object, ...] | None = None
        last_mark: tuple[float, ...] = ()
        while t < horizon:
            # -- compute until the next save is due
            stop = min(t + interval, next_fail, horizon)
            computed += stop - t
            work += stop - t
            t = stop
            if t >= horizon:
                break
            if t < next_fail:
                # -- a save: wait for the first tier's previous write, block, then hand it on
                if self.inflight[0] is not None:
                    self.settle(0, t)
                    if self.inflight[0] is not None:
                        ready = min(self.busy_until[0], next_fail, horizon)
                        blocked += ready - t
                        t = ready
                        if t >= horizon:
                            break
                        if t == next_fail:
                            t, work, restarting, fi, next_fail = self.failures(t, work, restarting, times, kinds, fi)
                            last_sig = None
                            continue
                        self.settle(0, t)
                end = t + blocked_s
                if end >= next_fail or end >= horizon:
                    ready = min(next_fail, horizon)
                    blocked += ready - t
                    t = ready
                    if t >= horizon:
                        break
                    t, work, restarting, fi, next_fail = self.failures(t, work, restarting, times, kinds, fi)
                    last_sig = None
                    continue
                blocked += blocked_s
                t = end
                saves += 1
                self.start_write(0, work, t)
                committed = t + first.write_s
                if committed <= next_fail:  # else the failure comes first and the drains never start
                    for k, every in later:
                        if saves % every == 0:
                            self.start_write(k, work, committed)
                # -- jump over whole repeating cycles of saves up to the next failure
                if saves % cycle == 0 and min(next_fail, horizon) - t > span:
                    sig = self.signature(t, work)
                    mark = (t, work, computed, blocked, *tally.bytes_by_tier)
                    if sig == last_sig:
                        dt = t - last_mark[0]
                        jumps = int((min(next_fail, horizon) - t) / dt) - 2 if dt > 0 else 0
                        if jumps > 0:
                            dwork = work - last_mark[1]
                            t += jumps * dt
                            work += jumps * dwork
                            computed += jumps * (computed - last_mark[2])
                            blocked += jumps * (blocked - last_mark[3])
                            saves += jumps * cycle
                            for k in range(len(tiers)):
                                tally.bytes_by_tier[k] += jumps * (mark[4 + k] - last_mark[4 + k])
                                for arr in (self.held, self.inflight, self.behind):
                                    v = arr[k]
                                    if v is not None:
                                        arr[k] = v + jumps * dwork
                                if self.inflight[k] is not None:
                                    self.busy_until[k] += jumps * dt
                                    self.busy_start[k] += jumps * dt
                            mark = (t, work, computed, blocked, *tally.bytes_by_tier)
                    last_sig, last_mark = sig, mark
                continue
            t, work, restarting, fi, next_fail = self.failures(t, work, restarting, times, kinds, fi)
            last_sig = None
        # what is still in flight at the end counts in proportion
        for k, tier in enumerate(tiers):
            self.settle(k, horizon)
            if self.inflight[k] is not None and tier.write_s > 0:
                done = (horizon - self.busy_start[k]) / tier.write_s
                tally.bytes_by_tier[k] += tier.bytes_per_write * min(1.0, max(0.0, done))
        tally.wall_s = horizon
        tally.useful_s = work
        tally.recompute_s = computed - work
        tally.blocked_s = blocked
        tally.restart_s = restarting
        tally.saves = saves
        return tally

    def failures(
        self, t: float, work: float, restarting: float, times: Sequence[float], kinds: Sequence[int], fi: int
    ) -> tuple[float, float, float, int, float]:
        """The failure at ``times[fi] == t`` and any that strike during the restarts it causes.

        Returns the new (time, position, restart time so far, next failure index, next failure time).
        """
        nf, horizon = len(times), self.horizon
        while True:
            self.fail(t, kinds[fi])
            fi += 1
            next_fail = times[fi] if fi < nf else _INF
            position, read_s, index = self.restore_choice()
            work = position
            up = t + self.s.reschedule_s + read_s
            if up <= next_fail and up < horizon:
                restarting += up - t
                if index >= 0:
                    self.tally.restores_by_tier[index] += 1
                else:
                    self.tally.restarts_from_scratch += 1
                return up, work, restarting, fi, next_fail
            stop = min(next_fail, horizon)
            restarting += stop - t
            t = stop
            if t >= horizon:
                return t, work, restarting, fi, next_fail


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyResult:
    """One strategy over all the runs.

    Attributes:
        strategy: what was simulated.
        tallies: one per run (trace).
        goodput: mean goodput over the runs.
        goodput_ci95: 95% confidence interval of the mean (Student's t over the runs).
    """

    strategy: Strategy
    tallies: tuple[Tally, ...]
    goodput: float
    goodput_ci95: tuple[float, float]

    def total(self, attribute: str) -> float:
        """Sum of a :class:`Tally` attribute over the runs."""
        return float(sum(getattr(t, attribute) for t in self.tallies))

    def share(self, attribute: str) -> float:
        """A :class:`Tally` time attribute as a fraction of all the wall time simulated."""
        wall = self.total("wall_s")
        return self.total(attribute) / wall if wall > 0 else 0.0

    @property
    def bytes_by_tier(self) -> dict[str, float]:
        """Bytes written to each tier over all runs."""
        out = dict.fromkeys((tier.name for tier in self.strategy.tiers), 0.0)
        for tally in self.tallies:
            for tier, value in zip(self.strategy.tiers, tally.bytes_by_tier, strict=True):
                out[tier.name] += value
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """Strategies run on the same failure traces.

    Attributes:
        results: one per strategy, in the order given.
        days: simulated days per run.
        runs: independent traces.
        seed: the seed of the first trace.
        failures: how failures were drawn.
        failures_per_run: failures in each trace.
    """

    results: tuple[StrategyResult, ...]
    days: float
    runs: int
    seed: int
    failures: FailureSpec
    failures_per_run: tuple[int, ...]

    def get(self, name: str) -> StrategyResult | None:
        """The result of the strategy called ``name``, if it was simulated."""
        return next((r for r in self.results if r.strategy.name == name), None)


# Student's t, two-sided 95%, by degrees of freedom; past 30 the normal value is close enough.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
_T95_TAIL = {20: 2.086, 25: 2.060, 30: 2.042}


def _t95(dof: int) -> float:
    if dof <= len(_T95):
        return _T95[dof - 1]
    for limit, value in sorted(_T95_TAIL.items()):
        if dof <= limit:
            return value
    return 1.96


def mean_ci95(values: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """The mean of ``values`` and its 95% confidence interval (a point for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, (mean, mean)
    half = _t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, (mean - half, mean + half)


def compare(
    strategies: Sequence[Strategy],
    failures: FailureSpec,
    *,
    days: float,
    runs: int = 10,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Comparison:
    """Run every strategy on the same ``runs`` failure traces of ``days`` days each.

    Trace ``i`` is drawn from ``random.Random(seed + i)``, so a seed gives the same figures everywhere.

    Args:
        strategies: what to compare.
        failures: how failures arrive.
        days: simulated days per run.
        runs: independent traces (the 95% interval is over these).
        seed: seed of the first trace.
        progress: called with (runs done, runs) after each run.

    Raises:
        ConfigError: no strategies, two with one name, a non-positive duration or run count.
    """
    if not strategies:
        raise ConfigError("nothing to simulate: give at least one strategy")
    names = [s.name for s in strategies]
    if len(set(names)) != len(names):
        raise ConfigError(f"strategy names must differ, got {names}")
    horizon = require_positive("simulated days", days) * SECONDS_PER_DAY
    require_count("runs", runs)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"the seed must be an integer, got {seed!r}")
    tallies: list[list[Tally]] = [[] for _ in strategies]
    counts: list[int] = []
    for i in range(runs):
        times, kinds = failure_trace(failures, horizon, random.Random(seed + i))
        counts.append(len(times))
        for j, strategy in enumerate(strategies):
            tallies[j].append(run_trace(strategy, times, kinds, horizon))
        if progress is not None:
            progress(i + 1, runs)
    results = []
    for strategy, runs_of in zip(strategies, tallies, strict=True):
        mean, ci = mean_ci95([t.goodput for t in runs_of])
        results.append(StrategyResult(strategy=strategy, tallies=tuple(runs_of), goodput=mean, goodput_ci95=ci))
    return Comparison(
        results=tuple(results),
        days=float(days),
        runs=runs,
        seed=seed,
        failures=failures,
        failures_per_run=tuple(counts),
    )
