"""Asynchronous save: snapshot consistency, streaming through a small staging budget, background errors,
back-pressure, shutdown (close, interpreter exit, SIGTERM), statistics, schedule, memory."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import tiersave
from helpers import assert_same, listing
from tiersave.errors import StorageError
from tiersave.events import read_events
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import Fault, FaultyStorage


def big_state(seed: int = 0, mib: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = mib * (1 << 20) // 4 // 8
    return {
        "layers": [torch.randn(n, generator=g) for _ in range(8)],
        "t": torch.randn(300, 200, generator=g).t(),  # non-contiguous
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "np": np.arange(5000, dtype=np.float64),
        "step": seed,
    }


def clone(state):
    out = {k: v for k, v in state.items()}
    out["layers"] = [t.clone() for t in state["layers"]]
    out["t"] = state["t"].clone()
    out["bf16"] = state["bf16"].clone()
    out["np"] = state["np"].copy()
    return out


def test_changes_after_save_async_never_leak_into_the_checkpoint(root):
    state = big_state(1)
    expected = clone(state)
    gate = threading.Event()
    storage = FaultyStorage(LocalStorage(root), gates={"finish": gate})  # hold the write back
    with tiersave.Checkpointer(storage) as ckpt:
        handle = ckpt.save_async(1, state)
        assert handle.staged() and not handle.done()
        for t in state["layers"]:
            t.fill_(7.0)  # training goes on and changes everything in place
        state["t"].zero_()
        state["bf16"].fill_(3)
        state["np"][:] = -1
        gate.set()
        info = handle.result(timeout=60)
        assert info.step == 1
        assert_same(ckpt.restore(1), expected)


def test_streaming_through_a_budget_smaller_than_the_state(root):
    state = big_state(2, mib=8)
    budget = 256 << 10  # 256 KiB of staging for an 8 MiB state

    class Gate(threading.Event):  # says when a write first waits on it: the hold below starts there
        def __init__(self) -> None:
            super().__init__()
            self.reached = threading.Event()

        def wait(self, timeout: float | None = None) -> bool:
            self.reached.set()
            return super().wait(timeout)

    gate = Gate()
    storage = FaultyStorage(LocalStorage(root), gates={"write_at": gate})
    with tiersave.Checkpointer(storage, staging_bytes=budget, io_threads=3) as ckpt:
        result: dict = {}
        saver = threading.Thread(target=lambda: result.update(handle=ckpt.save_async(1, state)))
        saver.start()
        assert gate.reached.wait(30)
        saver.join(0.8)
        assert saver.is_alive()  # back-pressure: the ring is full and no write may finish
        gate.set()
        saver.join(60)
        handle = result["handle"]
        handle.result(60)
        assert ckpt._saver.arena.capacity <= budget < handle.stats.stored_bytes
        assert handle.stats.stage_wait_s > 0.4
        assert ckpt.catalog.manifest(1).chunk_bytes == budget // 2
        assert_same(ckpt.restore(1), state)
        assert ckpt.verify(1).ok


def test_the_staging_arena_is_allocated_once_and_reused(root):
    with tiersave.Checkpointer(root, keep_last=2) as ckpt:
        for step in range(1, 21):
            ckpt.save_async(step, big_state(step, mib=1))
        ckpt.wait()
        assert ckpt._saver.arena.allocations == 1
        assert [i.step for i in ckpt.list()] == [19, 20]


def test_background_error_is_raised_by_the_handle_and_retention_does_not_run(root):
    storage = FaultyStorage(LocalStorage(root))
    with tiersave.Checkpointer(storage, keep_last=1) as ckpt:
        ckpt.save(1, big_state(1, mib=1))
        storage.faults = [Fault("finish", storage.ops["finish"] + 1)]  # fsync of the next save fails
        handle = ckpt.save_async(2, big_state(2, mib=1))
        with pytest.raises(StorageError, match="injected"):
            handle.result(timeout=60)
        assert handle.failed()
        assert ckpt.catalog.steps() == [1]  # keep_last=1 did not delete step 1 for a save that failed
        assert_same(ckpt.restore(), big_state(1, mib=1))
        assert listing(root) == ["step-0000000001"]


def test_unobserved_background_error_is_raised_by_the_next_save(root):
    storage = FaultyStorage(LocalStorage(root))
    with tiersave.Checkpointer(storage) as ckpt:
        storage.faults = [Fault("finish", 1)]
        handle = ckpt.save_async(1, big_state(1, mib=1))
        handle.wait(60)
        with pytest.raises(tiersave.SaveError, match="the save of step 1 failed and nobody observed it") as info:
            ckpt.save(2, big_state(2, mib=1))
        assert isinstance(info.value.__cause__, StorageError)
        assert ckpt.catalog.steps() == []
        ckpt.save(2, big_state(2, mib=1))  # observed now: the next save goes ahead
        assert ckpt.catalog.steps() == [2]


def test_on_busy_skip_raise_and_wait(root):
    gate = threading.Event()
    storage = FaultyStorage(LocalStorage(root), gates={"finish": gate})
    with tiersave.Checkpointer(storage, on_busy="skip") as ckpt:
        first = ckpt.save_async(1, big_state(1, mib=1))
        with pytest.warns(tiersave.TiersaveWarning, match="skipping the save of step 2.*1 skipped so far"):
            skipped = ckpt.save_async(2, big_state(2, mib=1))
        assert skipped.skipped and skipped.done() and skipped.result() is None
        assert ckpt.skipped_saves == 1
        ckpt.on_busy = "raise"
        with pytest.raises(tiersave.SaveError, match="still being written"):
            ckpt.save_async(3, big_state(3, mib=1))
        ckpt.on_busy = "wait"
        threading.Timer(0.3, gate.set).start()
        ckpt.save(4, big_state(4, mib=1))  # waits for step 1, then saves
        assert first.done() and ckpt.catalog.steps() == [1, 4]
    events = read_events(root / "tiersave-events.jsonl")
    assert [(e["step"], e["outcome"]) for e in events] == [(2, "skipped"), (1, "committed"), (4, "committed")]


def test_close_raises_an_unobserved_background_failure(root):
    storage = FaultyStorage(LocalStorage(root), [Fault("finish", 1)])
    ckpt = tiersave.Checkpointer(storage)
    ckpt.save_async(1, big_state(1, mib=1))
    with pytest.raises(tiersave.SaveError, match="the save of step 1 failed and nobody observed it"):
        ckpt.close()
    with (
        pytest.raises(tiersave.SaveError),
        tiersave.Checkpointer(FaultyStorage(LocalStorage(root), [Fault("finish", 1)])) as c,
    ):
        c.save_async(2, big_state(2, mib=1))
    assert tiersave.Checkpointer(root).catalog.steps() == []


def test_close_waits_for_the_in_flight_save(root):
    storage = FaultyStorage(LocalStorage(root), delays={"finish": 0.5})
    ckpt = tiersave.Checkpointer(storage)
    handle = ckpt.save_async(1, big_state(1, mib=1))
    assert ckpt.close() is True
    assert handle.done() and ckpt.catalog.steps() == [1]


def test_close_with_a_stuck_save_reports_it_and_shows_nothing(root):
    gate = threading.Event()
    storage = FaultyStorage(LocalStorage(root), gates={"finish": gate})
    ckpt = tiersave.Checkpointer(storage)
    handle = ckpt.save_async(2, big_state(2, mib=1))
    with pytest.warns(tiersave.TiersaveWarning, match="the save of step 2 had not committed before close"):
        assert ckpt.close(timeout=0.2) is False
    assert not handle.done()
    assert tiersave.Checkpointer(root).catalog.steps() == []  # nothing half-visible
    gate.set()


def _run_script(tmp_path, body: str, *, sigterm_after: float | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(body)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if sigterm_after is not None:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(sigterm_after)
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


SLOW_SAVE = textwrap.dedent("""
    import sys, torch, tiersave
    from tiersave.storage.posix import LocalStorage
    from tiersave.testing.faults import FaultyStorage
    storage = FaultyStorage(LocalStorage({root!r}), delays={{"finish": 1.0}})
    ckpt = tiersave.Checkpointer(storage, exit_timeout_s=30)
    ckpt.save_async(7, {{"w": torch.arange(100000.0)}})
    print("ready", flush=True)
""")


def test_interpreter_exit_finishes_the_in_flight_save(tmp_path, root):
    out = _run_script(tmp_path, SLOW_SAVE.format(root=str(root)) + "\nprint('exiting')\n")
    assert out.returncode == 0, out.stderr
    assert "tiersave: the interpreter is exiting: finishing the save of step 7" in out.stderr
    with tiersave.Checkpointer(root) as ckpt:
        assert torch.equal(ckpt.restore(7)["w"], torch.arange(100000.0))


def test_sigterm_finishes_the_in_flight_save_then_terminates(tmp_path, root):
    body = SLOW_SAVE.format(root=str(root)) + "\nimport time\ntime.sleep(60)\n"
    out = _run_script(tmp_path, body, sigterm_after=0.1)
    assert out.returncode == -signal.SIGTERM
    assert "tiersave: SIGTERM received: finishing the save of step 7" in out.stderr
    with tiersave.Checkpointer(root) as ckpt:
        assert ckpt.catalog.steps() == [7] and ckpt.verify(7).ok


def test_sigterm_chains_to_the_previous_handler(tmp_path, root):
    body = (
        textwrap.dedent("""
    import signal, sys
    def mine(signum, frame):
        print("user handler ran", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, mine)
    """)
        + SLOW_SAVE.format(root=str(root))
        + "\nimport time\ntime.sleep(60)\n"
    )
    out = _run_script(tmp_path, body, sigterm_after=0.1)
    assert out.returncode == 3 and "user handler ran" in out.stdout
    with tiersave.Checkpointer(root) as ckpt:
        assert ckpt.catalog.steps() == [7]


def test_a_failed_background_save_is_reported_at_exit(tmp_path, root):
    body = textwrap.dedent("""
    import torch, tiersave
    from tiersave.storage.posix import LocalStorage
    from tiersave.testing.faults import Fault, FaultyStorage
    storage = FaultyStorage(LocalStorage({root!r}), [Fault("finish", 1)])
    ckpt = tiersave.Checkpointer(storage)
    ckpt.save_async(3, {{"w": torch.ones(10)}})
    """).format(root=str(root))
    out = _run_script(tmp_path, body)
    assert "tiersave: the save of step 3 FAILED" in out.stderr and "injected" in out.stderr


def test_stats_are_recorded_in_the_manifest_and_the_event_log(root):
    with tiersave.Checkpointer(root) as ckpt:
        handle = ckpt.save(5, big_state(5, mib=2), metrics={"loss": 0.5})
    stats = handle.stats
    assert stats.tensor_bytes > 2 << 20 and stats.stored_bytes % 4096 == 0 and stats.num_tensors == 11
    assert 0 < stats.blocked_s <= stats.total_s and stats.stage_s > 0 and stats.write_s > 0
    manifest = json.loads((root / "step-0000000005" / "manifest.json").read_text())
    assert manifest["stats"]["num_tensors"] == 11 and manifest["stats"]["blocked_s"] > 0
    (event,) = read_events(root / "tiersave-events.jsonl")
    assert event["step"] == 5 and event["outcome"] == "committed" and event["commit_s"] > 0


def test_due_follows_the_schedule(root):
    with tiersave.Checkpointer(root, schedule="steps:10") as ckpt:
        assert [s for s in range(1, 31) if ckpt.due(s)] == [10, 20, 30]
    with tiersave.Checkpointer(root) as ckpt, pytest.raises(tiersave.ConfigError, match="no schedule configured"):
        ckpt.due(1)
    with pytest.raises(tiersave.ConfigError):
        tiersave.Checkpointer(root, schedule="sometimes")


def test_auto_schedule_learns_the_blocked_time(root):
    with tiersave.Checkpointer(root, schedule="auto:mttf=1h") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, big_state(step, mib=1))
        sched = ckpt.schedule
        assert sched.cost_s < 1.0  # measured blocked time replaced the 5 s initial guess
        assert sched.interval_s < 60  # sqrt(2 * C * 3600) with C well under a second


def test_resident_memory_does_not_grow_over_100_saves(tmp_path):
    code = f"""
import resource, torch, tiersave
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
state = {{'w': [torch.randn(1 << 18) for _ in range(16)]}}  # 16 MiB
ckpt = tiersave.Checkpointer({str(tmp_path / "c")!r}, keep_last=1)
for step in range(1, 11):
    ckpt.save(step, state)
base = rss()
for step in range(11, 111):
    ckpt.save(step, state)
print(rss() - base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    growth, _ = map(int, out.stdout.split())
    assert growth < 8 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over 100 saves"


def test_stats_cli_table_json_and_plot(root, tmp_path, capsys):
    from tiersave.cli import main

    with tiersave.Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save_async(step, big_state(step, mib=1))
    assert main(["stats", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in doc["saves"]] == [1, 2, 3] and doc["summary"]["committed"] == 3
    png = tmp_path / "timeline.png"
    assert main(["stats", str(root), "--plot", str(png)]) == 0
    assert "blocked mean" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["stats", str(tmp_path / "missing")]) == 1


def test_prepare_allocates_staging_before_the_first_save(root):
    state = big_state(3, mib=2)
    with tiersave.Checkpointer(root) as ckpt:
        assert ckpt._saver.arena.capacity == 0
        ckpt.prepare(state)
        assert ckpt._saver.arena.capacity >= handle_bytes(state) and ckpt._saver.arena.allocations == 1
        handle = ckpt.save(1, state)
        assert ckpt._saver.arena.allocations == 1  # the save reused it
        assert handle.stats.extra["io"]  # bytes per I/O path of the local tier, recorded per save
        assert sum(handle.stats.extra["io"].values()) >= handle.stats.stored_bytes


def handle_bytes(state) -> int:
    from tiersave.format.layout import align_up
    from tiersave.state import flatten

    return sum(align_up(t.nbytes) for t in flatten(state).tensors)


def test_host_copier_splits_and_balances_copies_exactly():
    import random as _random

    from tiersave.engine.stage import HostCopier

    rng = _random.Random(5)
    sizes = [rng.choice([1, 4095, 4096, 70_001, 3 << 20, 17 << 20]) for _ in range(40)]
    src = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copier = HostCopier(threads=3)
    try:
        copies, off = [], 0
        for n in sizes:
            copies.append((dst.data_ptr() + off, src.data_ptr() + off, n))
            off += n
        rng.shuffle(copies)
        copier.copy_many(copies)
        assert torch.equal(dst, src)
        dst.zero_()
        copier.copy(dst.data_ptr(), src.data_ptr(), src.numel())  # one copy split over the threads
        assert torch.equal(dst, src)
    finally:
        copier.close()


def test_host_copier_lets_the_faster_thread_copy_more(monkeypatch):
    """copy_many's threads share one queue of pieces: a thread slowed down (a vCPU the host deschedules) copies
    less instead of holding the caller until it has copied an equal share."""
    import ctypes

    from tiersave.engine import stage

    copied: dict[str, int] = {}
    caller = threading.current_thread().name

    def memmove(dst, src, n):
        name = threading.current_thread().name
        if name != caller and name not in copied:
            time.sleep(0.5)  # the slow thread: its first piece outlasts the caller's whole share
        copied[name] = copied.get(name, 0) + n
        return ctypes.memmove(dst, src, n)

    monkeypatch.setattr(stage, "large_copy", lambda: (memmove, "slowed memmove"))
    src = torch.randint(0, 256, (96 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copier = stage.HostCopier(threads=2)
    try:
        half = src.numel() // 2
        copier.copy_many([(dst.data_ptr(), src.data_ptr(), half), (dst.data_ptr() + half, src.data_ptr() + half, half)])
    finally:
        copier.close()
    assert torch.equal(dst, src)
    assert sum(copied.values()) == src.numel()
    assert copied[caller] >= 0.75 * src.numel(), copied  # equal halves would be 0.5


def test_host_copier_checksums_what_it_copies_whole_and_split_over_threads():
    import crc32c

    from tiersave.engine.stage import HostCopier

    src = torch.randint(0, 256, ((48 << 20) + 4097,), dtype=torch.uint8)  # three parts of >= 16 MiB
    arena = torch.zeros((49 << 20,), dtype=torch.uint8)
    view = arena.numpy().data.cast("B")
    copier = HostCopier(threads=3)
    try:
        # sizes below one piece per thread, at a piece, across many fused steps, and split into three parts
        assert len(copier._parts(src.numel())) == 3
        for pos, n in ((0, 0), (4096, 1), (8192, 300_001), (0, 16 << 20), (4096, src.numel())):
            arena.zero_()
            crc = copier.copy_checksum(view, arena.data_ptr(), pos, src.data_ptr(), n)
            assert torch.equal(arena[pos : pos + n], src[:n]), (pos, n)
            assert not arena[:pos].any() and not arena[pos + n :].any(), (pos, n)
            assert crc == crc32c.crc32c(src[:n].numpy().tobytes()), (pos, n)
    finally:
        copier.close()


def test_a_finished_save_keeps_no_reference_to_the_saved_tensors(tmp_path):
    """Once a save is durable, dropping the state frees its tensors: an idle writer thread held its last
    task (the write job and, through it, the caller's tensors) until the next save."""
    with tiersave.Checkpointer(str(tmp_path / "root"), event_log=False) as ckpt:
        for blocking in (False, True):
            tensor = torch.ones(1 << 16)
            alive = weakref.ref(tensor)
            if blocking:
                ckpt.save(2, {"w": tensor})
            else:
                ckpt.save_async(1, {"w": tensor}).result()
            del tensor
            # The thread that resolved the handle may still be returning from the call that held the job (a
            # frame's locals, for microseconds); a thread that keeps it until the next save never lets go.
            deadline = time.monotonic() + 10
            while True:
                gc.collect()
                if alive() is None or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert alive() is None, "the save still holds the state it wrote"


def _chunked_state() -> dict[str, torch.Tensor]:
    """24 tensors of 256 KiB: with 128 KiB chunks, 48 write units that no run gathers."""
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(1 << 16, generator=g) for i in range(24)}


def test_an_async_save_hands_its_writes_to_one_task_per_writer_thread(tmp_path):
    """save_async's caller used to submit each write to the pool itself (411 for a GPT-like 3 GB state, 1.5 ms of
    its stall); the writes are now taken in order by one lane per writer thread, and every one still lands."""
    gate = threading.Event()  # holds every write, so nothing the save submits later is counted
    storage = FaultyStorage(LocalStorage(tmp_path, io="buffered"), gates={"write_at": gate})
    state = _chunked_state()
    with tiersave.Checkpointer(storage, io_threads=3, chunk_bytes=128 << 10, event_log=False) as ck:
        submitted = []
        real = ck._pool.submit

        def counting(fn, *args, **kwargs):
            submitted.append(fn)
            return real(fn, *args, **kwargs)

        ck._pool.submit = counting
        try:
            handle = ck.save_async(1, state)
            assert len(submitted) == 3
        finally:
            gate.set()  # else a failure above would leave the writes waiting on the gate
        handle.result(timeout=60)
        assert storage.ops["write_at"] == 48
        assert_same(ck.restore(1), state)


def test_a_failed_write_stops_the_other_writes_of_an_async_save(tmp_path):
    """Once one write of a save fails, the save is lost: the lanes stop taking writes (at most the one each
    other lane is in) instead of writing the rest for nothing, and nothing becomes visible."""
    # each write takes 20 ms, so the failed lane empties the queue long before the other lane takes its next
    storage = FaultyStorage(
        LocalStorage(tmp_path, io="buffered"), [Fault("write_at", nth=2)], delays={"write_at": 0.02}
    )
    with tiersave.Checkpointer(storage, io_threads=2, chunk_bytes=128 << 10, event_log=False) as ck:
        handle = ck.save_async(1, _chunked_state())
        with pytest.raises(StorageError, match="injected"):
            handle.result(timeout=60)
        # the failed write, the one before it, and what the other lane took meanwhile: not the 45 after them
        assert storage.ops["write_at"] < 10
        assert ck.list() == []


def test_a_failed_write_stops_the_other_writes_of_a_blocking_staged_save(tmp_path):
    """The same for a blocking save staged through the ring, one task per write (direct I/O): the tasks queued
    behind a failed write return without writing (all 48 were written before)."""
    storage = FaultyStorage(LocalStorage(tmp_path, io="direct"), [Fault("write_at", nth=2)], delays={"write_at": 0.02})
    with tiersave.Checkpointer(storage, io_threads=2, chunk_bytes=128 << 10, event_log=False) as ck:
        with pytest.raises(StorageError, match="injected"):
            ck.save(1, _chunked_state())
        assert storage.ops["write_at"] < 10
        assert ck.list() == []
        ck.save(2, _chunked_state())  # the next save writes everything again
        assert storage.ops["write_at"] >= 48 and [i.step for i in ck.list()] == [2]
