"""Movable tags (tags.py): ``ckpt.tag``/``untag``, ``tiersave tag``, restore and list resolving them, retention
keeping the tagged step, ``watch(tag=...)`` and ``tiersave watch --tag --exec`` in another process, and hostile
tag files (huge, bad JSON, wrong fields, a symbolic link, a step that is not or no longer committed)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.cli import main
from tiersave.errors import CheckpointNotFoundError, ConfigError, FormatError
from tiersave.storage import open_storage

SRC = str(Path(__file__).resolve().parents[2] / "src")


def state(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "step": step}


@pytest.fixture(params=["local", "mem"])
def any_root(request, root) -> str:
    return str(root) if request.param == "local" else f"mem://tags-{uuid.uuid4().hex}"


def test_tag_moves_and_restore_list_and_retention_follow_it(any_root):
    with tiersave.Checkpointer(any_root, keep_last=1) as ckpt:
        ckpt.save(1, state(1), tags=["serving"])  # a manifest tag of the same name: the movable one wins
        ckpt.save(2, state(2))
        tag = ckpt.tag(2, "serving")
        assert (tag.name, tag.step) == ("serving", 2)
        for step in range(3, 6):
            ckpt.save(step, state(step))
        # keep_last=1, yet the tagged step stays (and step 1 went: its manifest tag protects nothing)
        assert [i.step for i in ckpt.list()] == [2, 5]
        assert ckpt.list()[0].tags == ("serving",)
        assert ckpt.info(2).tags == ("serving",)
        assert ckpt.restore(tag="serving")["step"] == 2
        assert ckpt.restore(2, tag="serving")["step"] == 2
        with pytest.raises(CheckpointNotFoundError, match="not tagged 'serving'"):
            ckpt.restore(5, tag="serving")
        ckpt.tag(5, "serving")  # move it: step 2 is no longer protected
        ckpt.save(6, state(6))
        assert [i.step for i in ckpt.list()] == [5, 6]
        assert ckpt.restore(tag="serving")["step"] == 5
        assert ckpt.untag("serving") is True and ckpt.untag("serving") is False
        ckpt.save(7, state(7))
        assert [i.step for i in ckpt.list()] == [7]
        with pytest.raises(CheckpointNotFoundError, match="tagged 'serving'"):
            ckpt.restore(tag="serving")


def test_bad_tag_requests_are_clear_errors(any_root):
    with tiersave.Checkpointer(any_root) as ckpt:
        ckpt.save(1, state(1))
        with pytest.raises(CheckpointNotFoundError, match="cannot tag step 9 as 'serving': no committed checkpoint"):
            ckpt.tag(9, "serving")
        for bad in ("", "../x", "a/b", ".hidden", "x" * 65):
            with pytest.raises(ConfigError, match="not a valid tag name"):
                ckpt.tag(1, bad)
        with pytest.raises(ConfigError, match="step must be an integer"):
            ckpt.tag(-1, "serving")
        assert Catalog(open_storage(any_root, create=False)).tags.names() == []  # nothing was written


def test_a_tag_whose_step_vanished_is_reported_at_read_time(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state(1))
        ckpt.save(2, state(2))
        ckpt.tag(1, "serving")
        ckpt.catalog.delete(1)  # by hand (retention never would)
        with pytest.raises(CheckpointNotFoundError, match=r"tag 'serving' in .* points at step 1, which is no longer"):
            ckpt.restore(tag="serving")
        ckpt.save(1, state(10))  # the same step saved again is not the checkpoint that was tagged
        with pytest.raises(CheckpointNotFoundError, match="deleted and saved again"):
            ckpt.restore(tag="serving")
    assert main(["ls", str(root)]) == 0


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"{" * 10 + b" " * 5000, "over the 4096-byte limit"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"step": "1", "manifest_sha256": "' + b"0" * 64 + b'", "time": 1}', "'step' must be an integer"),
        (b'{"step": 1, "manifest_sha256": "xyz", "time": 1}', "'manifest_sha256' must be 64 hex digits"),
        (b'{"step": 1, "manifest_sha256": "' + b"0" * 64 + b'", "time": NaN}', "not valid JSON"),
        (b'{"step": 1, "step": 2}', "not valid JSON"),
    ],
)
def test_hostile_tag_files_are_format_errors_naming_the_file(root, content, match, capsys):
    with tiersave.Checkpointer(root, keep_last=1) as ckpt:
        ckpt.save(1, state(1))
        (root / "tags").mkdir()
        (root / "tags" / "serving.json").write_bytes(content)
        with pytest.raises(FormatError, match=match) as err:
            ckpt.restore(tag="serving")
        assert "tags/serving.json" in str(err.value)
        ckpt.save(2, state(2))  # retention goes on (the broken tag protects nothing) and says why
        assert [i.step for i in ckpt.list()] == [2]
        ckpt.tag(2, "serving")  # a good record replaces the broken one
        assert ckpt.restore(tag="serving")["step"] == 2


def test_a_symlinked_tag_file_is_never_followed(root, tmp_path):
    target = tmp_path / "elsewhere.json"
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state(1))
        sha = ckpt.tag(1, "real").manifest_sha256
        target.write_text(json.dumps({"step": 1, "manifest_sha256": sha, "time": 1.0}))
        os.symlink(target, root / "tags" / "serving.json")
        with pytest.raises(FormatError, match="symbolic link"):
            ckpt.restore(tag="serving")
    assert main(["ls", str(root)]) == 0  # not fatal to listing
    tags, _ = Catalog(open_storage(str(root), create=False)).tags.all()
    assert list(tags) == ["real"]  # a link is not a tag: it protects nothing, and names nothing


def test_watch_tag_yields_each_move_in_process(root):
    with tiersave.Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state(step))
        ckpt.tag(1, "serving")
        feed = tiersave.watch(root, tag="serving", poll_s=0.01, timeout_s=5)

        first_seen = threading.Event()

        def move():  # forward, then back: both are moves
            time.sleep(0.1)
            ckpt.tag(3, "serving")
            # the feed yields where the tag points when it looks: the move back waits until 3 was seen
            assert first_seen.wait(30)
            ckpt.tag(2, "serving")

        thread = threading.Thread(target=move)
        thread.start()
        seen = [next(feed).step]
        first_seen.set()
        seen.append(next(feed).step)
        thread.join()
    assert seen == [3, 2]
    assert [i.step for i in tiersave.watch(root, tag="serving", include_existing=True, timeout_s=0.05)] == [2]
    with pytest.raises(ConfigError, match="no after="):
        tiersave.watch(root, tag="serving", after=1)
    with pytest.raises(ConfigError, match="not a valid tag name"):
        tiersave.watch(root, tag="../x")


def wait_for_lines(path: Path, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and len(path.read_text().splitlines()) >= count):
        assert time.monotonic() < deadline, f"{path} did not reach {count} lines in {timeout_s} s"
        time.sleep(0.02)


def test_a_watcher_in_another_process_follows_a_tag_moved_by_a_writer(root, tmp_path):
    log = tmp_path / "exec.log"
    hook = f"{sys.executable} -c \"import sys; open(sys.argv[1], 'a').write(sys.argv[2] + ' ' + sys.argv[3] + '\\n')\""
    argv = [sys.executable, "-m", "tiersave.cli", "watch", str(root), "--tag", "serving", "--all", "--json"]
    argv += ["--count", "4", "--poll", "0.02", "--timeout", "60", "--exec", f"{hook} {log} {{step}} {{uri}}"]
    with tiersave.Checkpointer(root, keep_last=1) as writer:
        writer.save(1, state(1))
        writer.tag(1, "serving")
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC}, text=True
        )
        try:
            assert select.select([proc.stdout], [], [], 60)[0], "the watcher printed nothing in 60 s"
            first = json.loads(proc.stdout.readline())  # --all: where the tag points when it starts
            for step in range(2, 12):
                writer.save(step, state(step))
                if step in (4, 7, 11):
                    writer.tag(step, "serving")
                    wait_for_lines(log, 1 + (4, 7, 11).index(step) + 1)  # each move is handled before the next
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # keep_last=1, yet each tagged step stayed while the tag pointed at it (11 was tagged after its save's
        # retention ran: 7 goes at the next save)
        assert [i.step for i in writer.list()] == [7, 11]
    assert proc.returncode == 0, err
    steps = [first["step"]] + [json.loads(line)["step"] for line in out.splitlines()]
    assert steps == [1, 4, 7, 11]
    lines = log.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["1", "4", "7", "11"]
    assert lines[1].split()[1].endswith("step-0000000004")


def test_the_tag_command(root, capsys):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state(1))
        ckpt.save(2, state(2))
    assert main(["tag", str(root), "1", "serving"]) == 0
    assert "tag 'serving' -> step 1" in capsys.readouterr().out
    assert main(["tag", str(root), "2", "serving"]) == 0
    assert "moved from step 1" in capsys.readouterr().out
    assert main(["tag", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(t["name"], t["step"]) for t in doc["tags"]] == [("serving", 2)]
    assert main(["ls", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["tags"] for c in doc["checkpoints"]] == [[], ["serving"]]
    assert [(t["name"], t["step"]) for t in doc["tags"]] == [("serving", 2)]
    assert main(["prune", str(root), "--keep-last", "1"]) == 0  # by hand: the tagged step stays too
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(3, state(3))
    assert main(["tag", str(root), "1", "serving"]) == 1  # pruned before it was tagged
    assert "no committed checkpoint of step 1" in capsys.readouterr().err
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert [i.step for i in Catalog(open_storage(str(root), create=False)).infos()] == [2, 3]
    assert main(["tag", str(root), "9", "serving"]) == 1
    assert "no committed checkpoint of step 9" in capsys.readouterr().err
    assert main(["tag", str(root), "x", "serving"]) == 2
    assert main(["tag", str(root), "serving", "--delete"]) == 0
    assert main(["tag", str(root), "serving", "--delete"]) == 1
    capsys.readouterr()
    with tiersave.Checkpointer(root) as ckpt, pytest.raises(CheckpointNotFoundError):
        ckpt.restore(tag="serving")


def test_inspect_resolves_a_movable_tag(root, capsys):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state(1), tags=["serving"])
        ckpt.save(2, state(2), tags=["serving"])
        ckpt.tag(1, "serving")  # wins over the newer manifest tag
    assert main(["inspect", str(root), "--tag", "serving", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 1 and doc["tags"] == ["serving"]


def test_a_movable_tag_wins_over_a_later_tiers_manifest_tag(root):
    mem = f"mem://tags-{uuid.uuid4().hex}"
    with tiersave.Checkpointer(tiers=[mem, str(root)]) as ckpt:
        ckpt.save(1, state(1))
        ckpt.save(2, state(2), tags=["serving"])  # a manifest tag on a newer step, on both tiers
        ckpt.wait()
        ckpt.tag(1, "serving")  # on the first tier only
        assert ckpt.restore(tag="serving")["step"] == 1
        assert ckpt.last_restore.step == 1
