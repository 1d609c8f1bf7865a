"""Run the checkpoint benchmark: raw device limits, tiersave in each I/O mode, and the peers, side by side.

Procedure (in the spirit of the MLPerf Storage checkpointing workload):

1. Build the GPT-like state (:mod:`tiersave.bench.workload`) and a zero-filled twin to load into.
2. Calibrate the auto I/O policy for the directory's file system (outside every timed region).
3. ``warmup`` untimed rounds, then ``checkpoints`` timed rounds, each in the order of one row of a
   Williams design (:func:`round_order`), so that slow drifts of a shared machine and what one contender
   leaves the next (a delete's discards, a page cache dropped, writeback) fall on every contender alike:
   the raw device run, then every method's save (until durable) followed by its cold loads; the page
   cache is evicted before every timed operation;
   each method's files are removed after its loads, so the disk holds one checkpoint at a time. The
   warm-up exists because a job's first save allocates staging memory that later saves reuse, and on a
   virtual machine that hands freed memory back to its host (virtio-balloon free page reporting), new
   memory costs 1-3 GB/s of page faults: a first round would measure the allocator, not the storage.
4. Optionally (``ranks > 0``) one collective checkpoint in ``ranks`` processes, tiersave next to DCP.

Every loaded state is spot-checked against the saved one outside the timed region.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._version import __version__
from ..engine.memcopy import large_copy
from ..errors import ConfigError
from ..storage.posix import filesystem_type
from .config import BenchConfig
from .device import RawResult, evict, measure_raw
from .ranks import run_ranks
from .workload import StateSpec, gpt_like_spec

__all__ = ["BenchResult", "MethodResult", "run_bench"]

ProgressFn = Callable[[int, int, str], None]


@dataclass
class MethodResult:
    """Timings of one method over all rounds (seconds per round)."""

    name: str
    family: str
    save_s: list[float] = field(default_factory=list)
    blocked_s: list[float] = field(default_factory=list)
    load_s: dict[str, list[float]] = field(default_factory=dict)
    save_stats: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "save_s": [round(s, 6) for s in self.save_s],
            "blocked_s": [round(s, 6) for s in self.blocked_s],
            "load_s": {k: [round(s, 6) for s in v] for k, v in self.load_s.items()},
            "save_stats": self.save_stats,
        }


@dataclass
class BenchResult:
    """Everything one run measured; :func:`tiersave.bench.report.summarize` turns it into ratios."""

    config: BenchConfig
    state: StateSpec
    machine: dict[str, Any]
    calibration: dict[str, Any] | None
    raw: list[RawResult]
    methods: dict[str, MethodResult]
    eviction: str
    ranks: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def to_json(self) -> dict[str, Any]:
        from .report import summarize

        data = self._data()
        data["summary"] = summarize(data)
        return data

    def _data(self) -> dict[str, Any]:
        return {
            "tiersave_version": __version__,
            "config": self.config.to_json(),
            "machine": self.machine,
            "state": self.state.to_json(),
            "calibration": self.calibration,
            "eviction": self.eviction,
            "raw": [
                {"bytes": r.nbytes, "write_gbps": r.write, "read_gbps": r.read, "direct_refused": r.direct_refused}
                for r in self.raw
            ],
            "methods": {name: m.to_json() for name, m in self.methods.items()},
            "ranks": self.ranks,
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
        }


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _machine(directory: Path) -> dict[str, Any]:
    import torch

    st = os.stat(directory)
    mem = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "filesystem": filesystem_type(directory),
        "device": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}",
        "loadavg_start": _loadavg(),
        "stage_copy": large_copy()[1],  # the routine save_async stages host tensors with
    }


def _check_resources(config: BenchConfig, spec: StateSpec) -> None:
    free = shutil.disk_usage(config.directory).free
    need_disk = int(spec.nbytes * 1.3) + (64 << 20)
    if free < need_disk:
        raise ConfigError(
            f"{config.directory} has {free / 1e9:.1f} GB free; the benchmark needs about {need_disk / 1e9:.1f} GB"
        )
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    # the first phase holds the state, the twin to load into and one loaded copy; the second the state, a
    # staging arena, DCP's staging copy and the copy yardsticks' shared-memory buffer
    need_mem = 3 * spec.nbytes
    what = "state, load target, one loaded copy"
    copies = 1 + ("async" in config.io_modes) + ("dcp-async" in config.peers)
    copies += bool({"memcpy", "dlrover-shm"} & set(config.peers))
    if copies > 3:
        need_mem = copies * spec.nbytes
        what = "state, staging arena, DCP's async copy and the shared-memory buffer of the stall phase"
    if avail and avail < need_mem:
        raise ConfigError(
            f"the benchmark holds about {need_mem / 1e9:.1f} GB in memory ({what}); "
            f"only {avail / 1e9:.1f} GB is free: use a smaller --size"
        )


def _spot_check(saved: dict[str, Any], loaded: dict[str, Any], method: str) -> None:
    import torch

    names = list(saved)
    for name in {names[0], names[len(names) // 2], names[-1]}:
        got = loaded.get(name)
        if not isinstance(got, torch.Tensor) or not torch.equal(got, saved[name]):
            raise ConfigError(f"benchmark: {method} loaded different values for {name!r}")


def run_bench(config: BenchConfig, *, progress: ProgressFn | None = None) -> BenchResult:
    """Run the benchmark described by ``config`` and return its measurements.

    Raises:
        ConfigError: bad configuration, not enough disk or memory, or another run is using the directory.
        BackendUnavailableError: a requested peer's package is missing.
    """
    created = not config.directory.exists()
    config.directory.mkdir(parents=True, exist_ok=True)
    with _sole_run(config.directory):
        return _run(config, progress, created)


@contextlib.contextmanager
def _sole_run(directory: Path) -> Iterator[None]:
    """Hold ``directory`` for this run. Every run removes its methods' and its ranks' directories in it when it
    starts and ends, so a second run there would delete a save of this one midway (seen as a shard that
    vanished before the commit): it is refused instead, while this run holds the lock."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"{directory} is in use by another tiersave bench run: two runs in one directory delete each "
                "other's files; wait for it to end, or give this run a directory of its own"
            ) from None
        yield
    finally:
        os.close(fd)


_STALL_PEERS = ("dcp-async", "memcpy", "dlrover-shm")
"""The peers timed in the second phase, with ``tiersave-async``: the stalls of saves that return early."""


_SETTLE_S = 2.0
_SETTLE_BYTES_PER_S = 1.5e9
"""Between two rounds the page cache is evicted and the run pauses (2 s for a 3 GB state, less for smaller
ones), untimed. A Williams design balances which contender follows which inside a round, but the last of one
round precedes the first of the next, and with rows shifted from one another that pair is always the same
(measured: ``dcp-async``, whose 3 GB of page cache the next eviction drops, then ``tiersave-async``, once per
four rounds); with the pause, the first of a round follows no contender."""


def design_rows(n: int) -> int:
    """How many rounds one full cycle of :func:`round_order` takes for ``n`` contenders."""
    return n if n % 2 == 0 or n < 2 else 2 * n


def round_order(items: list[Any], rnd: int) -> list[Any]:
    """The order of timed round ``rnd``: row ``rnd`` of a Williams design, a Latin square balanced for what
    one contender leaves the next. Over :func:`design_rows` rounds (``n`` for an even number of items,
    ``2n`` for an odd one) every item runs in every position equally often and right after every other item
    equally often. (A rotation, even reversed every other cycle, puts each item after its two neighbours
    in the list only: measured, the async save then followed DCP's async save, whose 3 GB of page cache the
    next eviction drops, in half the rounds and the copy it is held against never did.)"""
    n = len(items)
    if n == 0:
        return []
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...: each difference between neighbours occurs once
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = rnd % design_rows(n)
    order = [items[(k + row) % n] for k in first]
    return order[::-1] if row >= n else order


def _phase(
    config: BenchConfig,
    methods: list[Any],
    state: dict[str, Any],
    template: dict[str, Any],
    results: dict[str, MethodResult],
    raws: list[RawResult],
    tick: Callable[[str], None],
    *,
    raw: bool = True,
) -> str:
    """Run ``methods`` (and the raw device, with ``raw``) for the warm-up and timed rounds, each round in
    the order :func:`round_order` gives it; close them at the end. Returns how the page cache was evicted."""
    directory = config.directory
    eviction = "fadvise"
    try:
        for m in methods:
            m.prepare(directory)
        order: list[Any] = ([None] if raw and config.raw else []) + list(methods)
        rounds = config.warmup + config.checkpoints
        settle_s = min(_SETTLE_S, _nbytes(state) / _SETTLE_BYTES_PER_S)
        for rnd in range(rounds):
            timed = rnd >= config.warmup
            what = f"round {rnd - config.warmup + 1}" if timed else f"warm-up {rnd + 1}"
            if rnd:  # the round's first contender follows no other (see _SETTLE_S)
                evict([directory], drop_caches=config.drop_caches)
                time.sleep(settle_s)
            for item in round_order(order, rnd - config.warmup):  # the timed rounds start the design
                if item is None:
                    tick(f"{what}: raw device write and read")
                    measured = measure_raw(directory, _nbytes(state), drop_caches=config.drop_caches)
                    if timed:
                        raws.append(measured)
                    continue
                res = results[item.name]
                tick(f"{what}: {item.name} save")
                eviction = evict([directory], drop_caches=config.drop_caches)
                timing = item.save(rnd, state)
                if timed:
                    res.save_s.append(timing.seconds)
                    res.blocked_s.append(timing.blocked_s)
                    if timing.stats:
                        res.save_stats.append(timing.stats)
                for variant in item.load_variants:
                    tick(f"{what}: {item.name} load ({variant})")
                    evict(item.paths(rnd), drop_caches=config.drop_caches)
                    seconds, loaded = item.load(rnd, variant, template)
                    if timed:
                        res.load_s.setdefault(variant, []).append(seconds)
                    _spot_check(state, loaded, item.name)
                    del loaded
                if not (config.keep and rnd == rounds - 1):
                    item.remove(rnd)
    finally:
        for m in methods:
            m.close()
    return eviction


def _nbytes(state: dict[str, Any]) -> int:
    return sum(int(t.nbytes) for t in state.values())


def _run(config: BenchConfig, progress: ProgressFn | None, created: bool) -> BenchResult:
    from ..storage.posix.calibration import Calibration, calibration_for
    from .methods import Method, TiersaveAsyncMethod, TiersaveMethod, make_peer
    from .references import REFERENCES, SharedBuffer, make_reference
    from .workload import build_state, empty_like_state

    started = time.perf_counter()
    directory = config.directory
    spec = gpt_like_spec(config.model, config.size_bytes)
    _check_resources(config, spec)
    notes: list[str] = []
    fstype = filesystem_type(directory)
    machine = _machine(directory)

    cal: Calibration | None = None
    if "auto" in config.io_modes or "async" in config.io_modes:
        cal = calibration_for(directory, fstype, refresh=config.recalibrate)
        if cal is None:
            notes.append("no calibration (O_DIRECT refused or disabled): auto uses its defaults")
    # Two phases, each interleaved in itself, so that the run fits in memory (a 3 GB state on 24 GB): the
    # saves until durable and the loads (the state, its load-into twin, a loaded copy, a staging arena per
    # tiersave mode), then the stalls (save_async, dcp.async_save, the copies into shared memory), which need
    # the state, one arena, DCP's staging copy and the shared-memory buffer but no twin.
    durable: list[Method] = [
        TiersaveMethod(m, io_threads=config.io_threads, calibration=cal) for m in config.io_modes if m != "async"
    ]
    stalls: list[Method] = []
    if "async" in config.io_modes:
        stalls.append(TiersaveAsyncMethod(io_threads=config.io_threads, calibration=cal))
    buffer = SharedBuffer()
    for p in config.peers:
        method = make_reference(p, buffer) if p in REFERENCES else make_peer(p)
        (stalls if p in _STALL_PEERS else durable).append(method)
    methods = durable + stalls
    for phase, n in (("saves and loads", len(durable) + bool(config.raw)), ("stalls", len(stalls))):
        rows = design_rows(n)
        if n > 1 and config.checkpoints % rows:
            notes.append(
                f"{phase}: {n} contenders, whose order balances what each leaves the next over {rows} rounds; "
                f"{config.checkpoints} timed rounds do not complete it (--checkpoints {rows} would)"
            )
    rounds = config.warmup + config.checkpoints
    steps = (1 if config.raw else 0) + sum(1 + len(m.load_variants) for m in durable)
    steps = steps * rounds + (len(stalls) * rounds if stalls else 0)
    total = steps + (2 if config.ranks > 0 else 0) + 1
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        if progress is not None:
            progress(done, total, label)
        done += 1

    tick("building the state")
    state = build_state(spec, seed=config.seed, aligned=config.aligned_state)
    results = {m.name: MethodResult(m.name, m.family) for m in methods}
    raws: list[RawResult] = []
    eviction = "fadvise"
    if durable or config.raw:
        template = empty_like_state(spec, aligned=config.aligned_state)
        eviction = _phase(config, durable, state, template, results, raws, tick)
        del template
    if stalls:
        eviction = _phase(config, stalls, state, {}, results, [], tick, raw=False)
    ranks_result = None
    if config.ranks > 0:
        tick(f"{config.ranks} ranks: tiersave save")
        ranks_result = run_ranks(config, cal)
        tick(f"{config.ranks} ranks: done")
    if created and not config.keep:
        shutil.rmtree(directory, ignore_errors=True)
    elif not config.keep:
        for m in methods:
            shutil.rmtree(directory / m.name, ignore_errors=True)
    machine["loadavg_end"] = _loadavg()
    if progress is not None:
        progress(total, total, "done")
    return BenchResult(
        config=config,
        state=spec,
        machine=machine,
        calibration=cal.to_json() if cal is not None else None,
        raw=raws,
        methods=results,
        eviction=eviction,
        ranks=ranks_result,
        notes=notes,
        seconds=time.perf_counter() - started,
    )
