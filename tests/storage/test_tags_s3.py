"""Movable tags on the object-store tier (the real SeaweedFS server): one PUT per tag record, restore and
retention following the tag, ``tiersave tag``/``ls`` and a watcher in another process on an ``s3://`` root."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiersave
from tiersave.cli import main
from tiersave.errors import CheckpointNotFoundError, FormatError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def state(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "step": step}


def test_tags_on_s3_move_protect_and_resolve(s3_storage):
    with tiersave.Checkpointer(s3_storage, keep_last=1) as ckpt:
        ckpt.save(1, state(1))
        with pytest.raises(CheckpointNotFoundError, match="cannot tag step 2"):
            ckpt.tag(2, "serving")
        ckpt.tag(1, "serving")
        assert s3_storage.exists("tags/serving.json")
        for step in (2, 3):
            ckpt.save(step, state(step))
        assert [(i.step, i.tags) for i in ckpt.list()] == [(1, ("serving",)), (3, ())]
        assert ckpt.restore(tag="serving")["step"] == 1
        ckpt.tag(3, "serving")
        ckpt.save(4, state(4))
        assert [i.step for i in ckpt.list()] == [3, 4]
        s3_storage.put("tags/serving.json", b'{"step": 3}')  # hostile: a record with fields missing
        with pytest.raises(FormatError, match="manifest_sha256"):
            ckpt.restore(tag="serving")
        s3_storage.put("tags/serving.json", b"x" * 10_000)
        with pytest.raises(FormatError, match="over the 4096-byte limit"):
            ckpt.restore(tag="serving")
        assert ckpt.untag("serving") is True


def test_tag_command_and_a_watcher_process_on_an_s3_root(seaweed, s3_bucket, monkeypatch, capsys):
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    uri = seaweed.uri(s3_bucket, "run")
    storage = seaweed.storage(s3_bucket, "run")
    with tiersave.Checkpointer(storage) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state(step))
    assert main(["tag", uri, "1", "serving"]) == 0
    argv = [sys.executable, "-m", "tiersave.cli", "watch", uri, "--tag", "serving", "--all", "--json", "--count", "3"]
    argv += ["--poll", "0.05", "--timeout", "60"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC}, text=True
    )
    try:
        seen = []
        for step in (3, 2):
            assert select.select([proc.stdout], [], [], 60)[0], "the watcher printed nothing in 60 s"
            seen.append(json.loads(proc.stdout.readline())["step"])
            assert main(["tag", uri, str(step), "serving"]) == 0
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert seen + [json.loads(line)["step"] for line in out.splitlines()] == [1, 3, 2]
    capsys.readouterr()
    assert main(["ls", uri, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(t["name"], t["step"]) for t in doc["tags"]] == [("serving", 2)]
    storage.close()
