"""A Checkpointer over a chain of real tiers: /dev/shm memory -> local ext4 -> SeaweedFS S3.

Cadence per tier, background drains acknowledged per tier, restore from the fastest valid copy with
fallback, per-tier retention that never deletes a drain's source, slow tiers widened, drain failures
reported without losing the checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings

import pytest
import torch

import tiersave
import tiersave.tiers
from helpers import S3_TEST_OPTIONS, assert_same
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import Fault, FaultyStorage
from tiersave.tiers import Tier


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(33, generator=g), "step": step}


@pytest.fixture
def mem_uri():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield f"mem://{name}"
    MemoryStorage(name).destroy()


@pytest.fixture
def s3_uri(seaweed, s3_bucket, monkeypatch):
    """An s3:// URI whose credentials come from the standard AWS environment variables."""
    seaweed.storage(s3_bucket, "run").close()  # creates the bucket
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    return seaweed.uri(s3_bucket, "run", **S3_TEST_OPTIONS)


def test_chain_cadence_drains_and_listing(mem_uri, s3_uri, tmp_path):
    tiers = [Tier(mem_uri), Tier(tmp_path / "local", every=2), Tier(s3_uri, every=3, keep=5)]
    with tiersave.Checkpointer(tiers=tiers) as ckpt:
        assert ckpt.tiers == ["memory", "local", "s3"]
        handles = []
        for step in range(1, 7):
            handles.append(ckpt.save(step, state_for(step)))
            ckpt.wait()  # saves minutes apart in a real job; here, let each drain finish first
        assert handles[5].tier_result("s3", timeout=120).step == 6
        assert handles[3].tier_result("local", timeout=120).step == 4
        with pytest.raises(tiersave.ConfigError, match="not sent to tier 's3'"):
            handles[0].tier_result("s3")
        ckpt.wait()
        holdings = {i.step: i.tiers for i in ckpt.list()}
        assert holdings == {2: ("local",), 3: ("s3",), 4: ("local",), 5: ("memory",), 6: ("memory", "local", "s3")}
        restored = ckpt.restore()
        assert ckpt.last_restore.tier == "memory" and ckpt.last_restore.step == 6
        assert_same(restored, state_for(6))
        assert_same(ckpt.restore(3), state_for(3))  # only the object store has it
        assert ckpt.last_restore.tier == "s3"
        assert ckpt.verify(6, tier="s3").ok


def test_corrupt_fast_copy_falls_back_to_the_next_tier(mem_uri, tmp_path):
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(tmp_path / "local")]) as ckpt:
        ckpt.save(1, state_for(1))
        ckpt.wait()
        shard = MemoryStorage(mem_uri.removeprefix("mem://")).root / "step-0000000001" / "shard-00000-000.bin"
        data = bytearray(shard.read_bytes())
        data[10] ^= 1
        shard.write_bytes(bytes(data))
        with pytest.warns(
            tiersave.TiersaveWarning, match="skipping the copy of step 1 on tier memory.*trying another tier"
        ):
            restored = ckpt.restore()
        assert_same(restored, state_for(1))
        assert ckpt.last_restore.tier == "local" and "checksum mismatch" in ckpt.last_restore.skipped[0][1]
        with pytest.warns(tiersave.TiersaveWarning):
            assert_same(ckpt.restore(1), state_for(1))  # an explicit step also falls back across tiers


def test_a_tier_failing_to_read_falls_back_to_the_next(mem_uri, tmp_path):
    broken = FaultyStorage(MemoryStorage(mem_uri.removeprefix("mem://")))
    with tiersave.Checkpointer(tiers=[Tier(broken, name="memory"), Tier(tmp_path / "local")]) as ckpt:
        ckpt.save(1, state_for(1))
        ckpt.wait()  # drained to local; from now on every read from memory fails
        broken.faults = [Fault("read_into", broken.ops["read_into"] + 1, persistent=True)]
        with pytest.warns(tiersave.TiersaveWarning, match="skipping the copy of step 1 on tier memory"):
            assert_same(ckpt.restore(), state_for(1))
        assert ckpt.last_restore.tier == "local"


def test_process_crash_with_the_checkpoint_only_in_memory(mem_uri, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch, tiersave
        from tiersave.tiers import Tier
        ckpt = tiersave.Checkpointer(tiers=[Tier({mem_uri!r}), Tier({str(tmp_path / "local")!r}, every=100)])
        g = torch.Generator().manual_seed(4)
        ckpt.save(4, {{"w": torch.randn(256, 1024, generator=g), "b": torch.randn(33, generator=g), "step": 4}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(tmp_path / "local", every=100)]) as ckpt:
        assert [i.tiers for i in ckpt.list()] == [("memory",)]
        assert_same(ckpt.restore(), state_for(4))
        assert ckpt.last_restore.tier == "memory"


def test_retention_never_deletes_a_drain_source_and_a_busy_tier_catches_up(mem_uri, tmp_path):
    gate = threading.Event()
    slow = FaultyStorage(LocalStorage(tmp_path / "slow"), gates={"finish": gate})
    tiers = [Tier(mem_uri, keep=1), Tier(slow, name="slow", every=1)]
    with tiersave.Checkpointer(tiers=tiers) as ckpt:
        try:
            h1 = ckpt.save(1, state_for(1))  # its drain blocks on the gate
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # one busy observation is no evidence of a slow tier: no warning
                h2 = ckpt.save(2, state_for(2))  # tier slow is busy: step 2 is deferred until it is idle
            mem = ckpt._chain.tiers[0].catalog
            assert mem.steps() == [1, 2]  # keep=1, but 1 is being drained and 2 waits to catch up
            with pytest.raises(tiersave.SaveTimeoutError):
                h2.tier_result("slow", timeout=0.05)  # deferred, not dropped: its result comes with the catch-up
        finally:
            gate.set()
        assert h1.tier_result("slow", timeout=60).step == 1
        assert h2.tier_result("slow", timeout=60).step == 2
        assert ckpt.wait(60)
        slow_tier = ckpt._chain.tiers[1]
        assert slow_tier.catalog.steps() == [1, 2]  # caught up: the newest save reached the slow tier
        assert slow_tier.every == 1  # not widened
        for step in range(3, 9):
            ckpt.save(step, state_for(step))
            ckpt.wait()
        assert mem.steps() == [8]  # the drains are over: every step was released to retention
        assert slow_tier.catalog.steps() == list(range(1, 9))
    events = tiersave.events.read_events(tmp_path / "slow" / "tiersave-events.jsonl")
    assert [(e["step"], e["outcome"]) for e in events if e.get("tier") == "slow"][:4] == [
        (2, "drain_deferred"),
        (1, "drained"),
        (2, "catch_up"),
        (2, "drained"),
    ]


def test_a_tier_idle_after_a_burst_ends_with_the_newest_checkpoint_its_cadence_selected(mem_uri, tmp_path):
    """Saves found the tier busy are deferred and the newest of them is caught up on: the tier ends holding the
    newest save its cadence selected. That is step 6 unless the burst widened the cadence, and how far it
    widens depends on the measured gaps between saves (on a loaded machine every 4th, leaving 5 and 6 out):
    the event log says which saves were selected (sent or deferred)."""
    slow = FaultyStorage(LocalStorage(tmp_path / "slow"), delays={"finish": 0.3})
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(slow, name="slow")]) as ckpt:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tiersave.TiersaveWarning)  # the burst may widen the cadence
            for step in range(1, 7):
                ckpt.save(step, state_for(step))
        assert ckpt.wait(60)
        tier = ckpt._chain.tiers[1]
        events = tiersave.events.read_events(tmp_path / "slow" / "tiersave-events.jsonl")
        selected = [
            e["step"] for e in events if e.get("tier") == "slow" and e["outcome"] in ("drained", "drain_deferred")
        ]
        assert 2 in selected  # step 1's drain takes 0.3 s: step 2 found the tier busy and was deferred, not dropped
        newest = max(selected)
        assert tier.every > 1 or newest == 6  # not widened: every save was selected
        assert tier.catalog.steps()[-1] == newest  # the deferred newest was caught up on, not lost
    with tiersave.Checkpointer(tiers=[Tier(tmp_path / "slow")]) as reopened:
        assert reopened.latest().step == newest


def test_a_widened_tier_catches_up_on_the_newest_save_of_its_configured_cadence(mem_uri, tmp_path):
    """Saves that a widened cadence leaves out, but the configured one selects, replace the save waiting to catch
    up while the tier is busy: still one catch-up, of the newest checkpoint (it used to be the older save that
    happened to be due under the widened cadence). To an idle tier they are not sent: the widening holds."""
    gate = threading.Event()
    slow = FaultyStorage(LocalStorage(tmp_path / "slow"), gates={"finish": gate})
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(slow, name="slow")]) as ckpt:
        tier = ckpt._chain.tiers[1]
        try:
            ckpt.save(1, state_for(1))  # its drain waits at the gate
            handles = {2: ckpt.save(2, state_for(2))}  # due, found busy: deferred
            # as if the tier had been measured unable to keep up (how far it widens depends on timing): no later
            # save is due under the widened cadence, every one under the configured one
            tier.widened_every = 100
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no widening warning: these saves are not due
                handles[3] = ckpt.save(3, state_for(3))
                handles[4] = ckpt.save(4, state_for(4))
            # each replaced by the next before the tier was idle: told so at once, not at the end of the drain
            with pytest.raises(tiersave.DrainSupersededError, match=r"step 2 was not copied to tier slow: .* step 3"):
                handles[2].tier_result("slow", timeout=0)
            with pytest.raises(tiersave.DrainSupersededError, match=r"step 3 was not copied .* step 4, a newer save"):
                handles[3].tier_result("slow", timeout=0)
        finally:
            gate.set()
        assert handles[4].tier_result("slow", timeout=60).step == 4
        assert ckpt.wait(60)
        assert tier.catalog.steps() == [1, 4]  # one catch-up, of the newest save
        tier.widened_every = 100  # again: the fast catch-up narrowed it back toward the measured need
        fifth = ckpt.save(5, state_for(5))  # the tier is idle now: the widened cadence leaves 5 out
        with pytest.raises(tiersave.ConfigError, match="not sent to tier 'slow'"):
            fifth.tier_result("slow")
        assert ckpt.wait(60)
        assert tier.catalog.steps() == [1, 4]
        assert ckpt._chain.tiers[0].catalog.steps()[-1] == 5
    events = tiersave.events.read_events(tmp_path / "slow" / "tiersave-events.jsonl")
    assert [(e["step"], e["outcome"]) for e in events if e.get("tier") == "slow"] == [
        (2, "drain_deferred"),
        (3, "drain_deferred"),
        (4, "drain_deferred"),
        (1, "drained"),
        (4, "catch_up"),
        (4, "drained"),
    ]


def test_every_save_sent_to_a_busy_tier_gets_a_result_there_or_is_told_it_was_superseded(mem_uri, tmp_path):
    """Due saves that find the tier busy are deferred: the one still waiting when the tier is idle is copied and
    its ``tier_result`` returns its info there; one replaced by a newer save first raises DrainSupersededError
    at once (it used to have no result on the tier at all: ConfigError, "not sent")."""
    gate = threading.Event()
    slow = FaultyStorage(LocalStorage(tmp_path / "slow"), gates={"finish": gate})
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(slow, name="slow")]) as ckpt:
        try:
            first = ckpt.save(1, state_for(1))  # its drain waits at the gate
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", tiersave.TiersaveWarning)  # busy twice in a row: widened
                second, third = ckpt.save(2, state_for(2)), ckpt.save(3, state_for(3))
            with pytest.raises(tiersave.DrainSupersededError, match=r"step 2 was not copied .* step 3, a newer"):
                second.tier_result("slow", timeout=0)
        finally:
            gate.set()
        assert [first.tier_result("slow", 60).step, third.tier_result("slow", 60).step] == [1, 3]
        assert ckpt.wait(60)
        assert ckpt._chain.tiers[1].catalog.steps() == [1, 3]
        assert second.result().step == 2  # on the first tier it is as committed as any


def test_a_drain_task_that_raises_leaves_no_tier_result_waiting(mem_uri, tmp_path, monkeypatch):
    """An error that escapes a drain task (here the tier's retention raising something other than a storage
    error) ends the drain: the save deferred behind it gets that error as its tier result instead of waiting
    for a drain that will never run, its source is let go, and the next due save is sent again."""
    gate = threading.Event()
    slow = FaultyStorage(LocalStorage(tmp_path / "slow"), gates={"finish": gate})
    retain = tiersave.tiers.TierChain.retain

    def retention_bug(self, tier, *args, **kwargs):
        if tier.name == "slow" and tier.catalog.steps() == [1]:
            raise RuntimeError("retention bug")
        return retain(self, tier, *args, **kwargs)

    monkeypatch.setattr(tiersave.tiers.TierChain, "retain", retention_bug)
    with tiersave.Checkpointer(tiers=[Tier(mem_uri, keep=1), Tier(slow, name="slow")]) as ckpt:
        try:
            first, second = ckpt.save(1, state_for(1)), ckpt.save(2, state_for(2))  # 2 deferred behind 1
        finally:
            gate.set()
        for handle in (first, second):
            with pytest.raises(RuntimeError, match="retention bug"):
                handle.tier_result("slow", timeout=60)
        ckpt.save(3, state_for(3)).tier_result("slow", timeout=60)
        assert ckpt.wait(60)
        assert ckpt._chain.tiers[0].catalog.steps() == [3]  # 1 and 2 were let go: retention removed them
        assert ckpt._chain.tiers[1].catalog.steps() == [1, 3]


def test_a_drain_that_cannot_be_started_is_the_saves_tier_result(mem_uri, tmp_path, monkeypatch):
    """The drain thread refuses the task (closed while a commit ran: close() timed out): the save is committed
    on the first tier, its tier result is that error at once, and the tier is not left marked busy."""
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(tmp_path / "slow", name="slow")]) as ckpt:
        drainer = ckpt._chain.tiers[1].drainer

        def closed(*args, **kwargs):
            raise tiersave.errors.ClosedError("the drain pool is shut down")

        monkeypatch.setattr(drainer, "submit", closed)
        handle = ckpt.save(1, state_for(1))
        assert handle.result().step == 1
        with pytest.raises(tiersave.errors.ClosedError, match="shut down"):
            handle.tier_result("slow", timeout=0)
        monkeypatch.undo()
        assert ckpt.save(2, state_for(2)).tier_result("slow", timeout=60).step == 2


def test_a_failed_drain_is_reported_and_the_checkpoint_stays_safe(mem_uri, tmp_path):
    flaky = FaultyStorage(LocalStorage(tmp_path / "flaky"), [Fault("finish", 1)])
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(flaky, name="flaky")]) as ckpt:
        with pytest.warns(tiersave.TiersaveWarning, match="copying step 1 to tier flaky .* failed"):
            handle = ckpt.save(1, state_for(1))
            with pytest.raises(tiersave.StorageError, match="injected"):
                handle.tier_result("flaky", timeout=60)
        assert ckpt._chain.tiers[1].catalog.steps() == []
        ckpt.save(2, state_for(2))
        ckpt.wait()
        assert {i.step: i.tiers for i in ckpt.list()} == {1: ("memory",), 2: ("memory", "flaky")}
    events = [e for e in tiersave.events.read_events(os.path.join(tmp_path, "flaky", "tiersave-events.jsonl"))]
    assert [(e["step"], e.get("tier"), e["outcome"]) for e in events if e.get("tier") == "flaky"] == [
        (1, "flaky", "drain_failed"),
        (2, "flaky", "drained"),
    ]


def test_a_save_due_as_the_drain_task_ends_is_still_drained(mem_uri, tmp_path, monkeypatch):
    """The drain task has found nothing to catch up on but has not returned yet when the next save commits:
    that save used to be deferred behind a task that would never send it, and wait() returned with the
    newest checkpoint on the first tier only (found by injecting a pause at that instant)."""
    ended, resume = threading.Event(), threading.Event()
    drain = tiersave.tiers.TierChain._drain

    def drain_then_linger(self, tier, step, future):
        drain(self, tier, step, future)
        if step == 1:
            ended.set()
            resume.wait(30)  # decided, not yet returned

    monkeypatch.setattr(tiersave.tiers.TierChain, "_drain", drain_then_linger)
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(tmp_path / "slow", name="slow")]) as ckpt:
        try:
            ckpt.save(1, state_for(1))
            assert ended.wait(30)
            ckpt.save(2, state_for(2))  # its drain is decided (sent or deferred) before save returns
        finally:
            resume.set()
        assert ckpt.wait(60)
        assert ckpt._chain.tiers[1].catalog.steps() == [1, 2]


def test_a_save_made_once_tier_result_returned_is_sent_not_deferred(mem_uri, tmp_path, monkeypatch):
    """tier_result() used to return before the drain task ended (the tier's retention still ran), so the next
    save could find the tier busy, be deferred, and have no result to wait for on it (ConfigError)."""
    retain = tiersave.tiers.TierChain.retain

    def slow_retention_on_slow(self, tier, *args, **kwargs):
        if tier.name == "slow":
            time.sleep(0.3)  # the window, widened
        return retain(self, tier, *args, **kwargs)

    monkeypatch.setattr(tiersave.tiers.TierChain, "retain", slow_retention_on_slow)
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(tmp_path / "slow", name="slow", keep=5)]) as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save(step, state_for(step)).tier_result("slow", 60).step == step
        assert ckpt._chain.tiers[1].catalog.steps() == [1, 2, 3]


def test_a_save_deferred_behind_a_failed_drain_is_still_drained(mem_uri, tmp_path):
    """The drain of step 1 fails while step 2 waits behind it: step 2 is sent all the same (it used to be
    dropped, and the tier never got it unless another save came)."""
    gate = threading.Event()
    flaky = FaultyStorage(LocalStorage(tmp_path / "flaky"), [Fault("finish", 1)], gates={"finish": gate})
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(flaky, name="flaky")]) as ckpt:
        try:
            with pytest.warns(tiersave.TiersaveWarning, match="copying step 1 to tier flaky .* failed"):
                first = ckpt.save(1, state_for(1))
                ckpt.save(2, state_for(2))  # step 1's drain is held at the gate: step 2 is deferred
                gate.set()
                with pytest.raises(tiersave.StorageError, match="injected"):
                    first.tier_result("flaky", timeout=60)
                assert ckpt.wait(60)
        finally:
            gate.set()
        assert ckpt._chain.tiers[1].catalog.steps() == [2]


def test_a_cancelled_tier_result_loses_nothing_behind_it(mem_uri, tmp_path):
    """A caller gives up on a tier's result (``cancel()``, as ``asyncio.wait_for`` on the wrapped future does):
    the drain task's result could then not be set, and the save waiting behind it was never sent and kept its
    source held on the first tier for good."""
    gate = threading.Event()
    slow = FaultyStorage(LocalStorage(tmp_path / "slow"), gates={"finish": gate})
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(slow, name="slow")]) as ckpt:
        try:
            first = ckpt.save(1, state_for(1))
            ckpt.save(2, state_for(2))  # deferred behind step 1's drain, held at the gate
            assert not first.tiers["slow"].cancel()  # the drain runs: nothing to cancel
        finally:
            gate.set()
        assert first.tier_result("slow", 60).step == 1
        assert ckpt.wait(60)
        assert ckpt._chain.tiers[1].catalog.steps() == [1, 2]
        assert ckpt._chain.protection.steps(0) == frozenset()


def test_slow_tier_cadence_is_widened_from_measured_drains(mem_uri, tmp_path):
    slow = FaultyStorage(LocalStorage(tmp_path / "slow"), delays={"finish": 0.6})
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(slow, name="slow")]) as ckpt:

        def burst():
            for step in range(1, 9):  # saves arrive much faster than the slow tier drains
                ckpt.save(step, state_for(step))
            ckpt.wait()

        with pytest.warns(tiersave.TiersaveWarning, match="tier slow .* cannot keep up"):
            burst()
        tier = ckpt._chain.tiers[1]
        assert tier.every > 1  # widened
        assert 1 <= len(tier.catalog.steps()) < 8


@pytest.mark.parametrize(
    ("tiers", "fragment"),
    [
        (lambda p, m: [Tier(m, every=2), Tier(p / "a")], "the first tier"),
        (lambda p, m: [Tier(p / "a", name="x"), Tier(p / "b", name="x")], "tier names must differ"),
        (lambda p, m: [Tier(p / "a"), Tier(p / "a", name="again")], "two tiers point at the same place"),
        (lambda p, m: [], "at least one tier"),
    ],
)
def test_bad_chains(tmp_path, mem_uri, tiers, fragment):
    with pytest.raises(tiersave.ConfigError, match=fragment):
        tiersave.Checkpointer(tiers=tiers(tmp_path, mem_uri))


def test_tier_arguments_are_validated(tmp_path):
    with pytest.raises(tiersave.ConfigError, match="every must be a positive integer"):
        Tier(tmp_path, every=0)
    with pytest.raises(tiersave.ConfigError, match="either every"):
        Tier(tmp_path, every=2, every_s=10)
    with pytest.raises(tiersave.ConfigError, match="either a root"):
        tiersave.Checkpointer(tmp_path / "a", tiers=[tmp_path / "b"])
    with pytest.raises(tiersave.ConfigError, match="unknown retention part"):
        tiersave.Checkpointer(tiers=[Tier(tmp_path / "a", keep="most=3")])
