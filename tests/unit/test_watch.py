"""tiersave.watch and `tiersave watch`: a reader follows a root and sees each committed checkpoint, in order,
never a partial one, and a writer's retention never makes it fail."""

from __future__ import annotations

import importlib
import json
import threading
import time

import pytest
import torch

import tiersave
from tiersave.cli import main
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import FaultyStorage


def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


def test_yields_each_new_checkpoint_in_order_and_each_restores(root):
    with tiersave.Checkpointer(root) as writer:
        writer.save(1, state(1))
        feed = tiersave.watch(root, poll_s=0.01, timeout_s=5)

        def write():
            for step in (2, 3, 4):
                time.sleep(0.05)
                writer.save(step, state(step))

        thread = threading.Thread(target=write)
        thread.start()
        seen = [next(feed).step for _ in range(3)]
        thread.join()
    assert seen == [2, 3, 4]  # step 1 existed before: only new ones
    with tiersave.Checkpointer(root) as reader:
        assert [reader.restore(s)["step"] for s in seen] == seen


def test_include_existing_and_after(root):
    with tiersave.Checkpointer(root) as writer:
        for step in (1, 2, 3):
            writer.save(step, state(step))
    assert [i.step for i in tiersave.watch(root, include_existing=True, poll_s=0.01, timeout_s=0.05)] == [1, 2, 3]
    assert [i.step for i in tiersave.watch(root, after=1, poll_s=0.01, timeout_s=0.05)] == [2, 3]
    assert list(tiersave.watch(root, poll_s=0.01, timeout_s=0.05)) == []  # nothing new: ends at the timeout


def test_a_save_in_progress_is_not_seen_until_it_is_committed(root):
    gate = threading.Event()
    storage = FaultyStorage(LocalStorage(root), gates={"put": gate})  # the manifest put is the commit
    polls = []
    with tiersave.Checkpointer(storage) as writer:
        handle = writer.save_async(1, state(1))  # staged and written, held before its commit

        def fake_sleep(seconds: float) -> None:
            polls.append(seconds)
            if len(polls) == 20:  # after 20 looks at a root holding only the unfinished save: commit it
                gate.set()
                handle.result(30)

        info = next(tiersave.watch(root, include_existing=True, poll_s=0.01, timeout_s=60, sleep=fake_sleep))
    assert info.step == 1 and len(polls) == 20  # seen on the first look after the commit, never before


def test_a_watcher_that_falls_behind_a_fast_writer_with_retention_never_fails(root):
    with tiersave.Checkpointer(root, keep_last=1) as writer:
        writer.save(1, state(1))
        feed = tiersave.watch(root, poll_s=0.001, timeout_s=2)
        seen = []

        def write():
            for step in range(2, 40):
                writer.save(step, state(step))

        thread = threading.Thread(target=write)
        thread.start()
        for info in feed:
            seen.append(info.step)
            if info.step == 39:
                break
        thread.join()
    assert seen == sorted(set(seen)) and seen[-1] == 39  # increasing, ends with the newest, no error


def test_bad_arguments(root):
    with pytest.raises(tiersave.ConfigError, match="poll_s"):
        next(tiersave.watch(root, poll_s=0))
    with pytest.raises(tiersave.ConfigError, match="timeout_s"):
        next(tiersave.watch(root, timeout_s=-1))
    assert main(["watch", str(root), "--count", "0"]) == 2


def test_the_watch_command_prints_json_lines(root, capsys):
    with tiersave.Checkpointer(root) as writer:
        writer.save(1, state(1))
        timer = threading.Timer(0.3, lambda: writer.save(2, state(2)))
        timer.start()
        code = main(["watch", str(root), "--poll", "0.02", "--timeout", "20", "--count", "1", "--json"])
        timer.join()
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 2


@pytest.mark.parametrize("kind", ["local", "mem"])
def test_a_commit_wakes_the_watcher_before_its_poll_interval(kind, root, tmp_path, monkeypatch):
    """inotify on local roots and mem://: with a 30 s poll interval and a 10 s timeout, polling alone would end
    the iteration with nothing; the watcher sees the commits because the rename into the root wakes it."""
    if kind == "mem":
        monkeypatch.setenv("TIERSAVE_SHM_DIR", str(tmp_path / "shm"))
        root = "mem://watch-inotify"
    with tiersave.Checkpointer(root) as writer:
        writer.save(1, state(1))
        feed = tiersave.watch(root, poll_s=30, timeout_s=10)

        def write():
            for step in (2, 3):
                time.sleep(0.3)
                writer.save(step, state(step))

        thread = threading.Thread(target=write)
        thread.start()
        started = time.monotonic()
        seen = [next(feed).step for _ in range(2)]
        elapsed = time.monotonic() - started
        thread.join()
        feed.close()
    assert seen == [2, 3]
    assert elapsed < 30, elapsed  # not by the first poll: that comes after 30 s


def test_a_moved_tag_wakes_the_watcher(root):
    with tiersave.Checkpointer(root, keep_last=3) as writer:
        writer.save(1, state(1))
        writer.save(2, state(2))
        writer.tag(1, "serving")
        feed = tiersave.watch(root, tag="serving", poll_s=30, timeout_s=10)
        timer = threading.Timer(0.3, writer.tag, (2, "serving"))
        timer.start()
        info = next(feed)
        timer.join()
        feed.close()
    assert info.step == 2


def test_a_commit_between_the_call_and_the_first_next_is_yielded(root):
    """The feed starts at the newest step when watch() is called, as documented: it used to start at the first
    next(), and a checkpoint committed in between was never yielded."""
    with tiersave.Checkpointer(root, keep_last=3) as writer:
        writer.save(1, state(1))
        writer.tag(1, "serving")
        feed = tiersave.watch(root, poll_s=0.05, timeout_s=5)
        tags = tiersave.watch(root, tag="serving", poll_s=0.05, timeout_s=5)
        writer.save(2, state(2))
        writer.tag(2, "serving")
        assert next(feed).step == 2
        assert next(tags).step == 2
        feed.close()
        tags.close()


def test_a_commit_right_after_the_first_look_wakes_the_first_wait(root, monkeypatch):
    """inotify watches the root from the start of the iteration: a commit just after the first look (none
    new there) wakes the first wait, not the 30 s poll (the watch used to be made at that first wait)."""
    watch_module = importlib.import_module("tiersave.watch")  # the module: tiersave.watch is the function

    with tiersave.Checkpointer(root) as writer:
        writer.save(1, state(1))
        steps = watch_module.Catalog.steps
        looks: list[int] = []

        def steps_then_commit(self):  # the feed's first look, then a commit before its first wait
            found = steps(self)
            looks.append(len(found))
            if len(looks) == 2:  # the first was watch() reading where to start
                writer.save(2, state(2))
            return found

        monkeypatch.setattr(watch_module.Catalog, "steps", steps_then_commit)
        feed = tiersave.watch(root, poll_s=30, timeout_s=10)
        started = time.monotonic()
        info = next(feed)
        elapsed = time.monotonic() - started
        feed.close()
    assert info.step == 2 and looks[:2] == [1, 1]
    assert elapsed < 10, elapsed  # woken by the commit, not by the poll after 30 s (nor ended by the timeout)
