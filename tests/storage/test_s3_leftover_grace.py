"""Abandoned attempts of another host on an object store (the real SeaweedFS server): this host cannot ask
whether that writer lives, so its attempt is kept until nothing was added to it for the grace period
(``TIERSAVE_LEFTOVER_GRACE_S``), then the retention after a commit removes it without anyone running prune."""

from __future__ import annotations

import time

import pytest
import torch

import tiersave
from tiersave.commit import MarkerCommit, attempt_dirname
from tiersave.errors import ConfigError
from tiersave.format.layout import step_dirname
from tiersave.knobs import override_env

FOREIGN = attempt_dirname("4242-0badf00d-00000000feedface")  # pid 4242 on a host id that is not this one's


def _plant(storage) -> str:
    """An attempt of step 7 left by a writer on another host: two objects, no manifest."""
    prefix = f"{step_dirname(7)}/{FOREIGN}"
    storage.put(f"{prefix}/shard-00000-00000.bin", b"\0" * 4096)
    storage.put(f"{prefix}/part-1.json", b"{}")
    return prefix


def _kinds(storage) -> dict[str, str]:
    return {item.prefix: item.status for item in MarkerCommit(storage).leftovers()}


def test_another_hosts_attempt_survives_the_grace_then_goes_with_the_next_commit(s3_storage):
    prefix = _plant(s3_storage)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with tiersave.Checkpointer(s3_storage, keep_last=2) as ckpt:
        ckpt.save(1, state).result()  # default grace (a day): a writer elsewhere may still be at work
        assert _kinds(s3_storage) == {prefix: "unknown"}
        time.sleep(2.5)  # object timestamps have a resolution of one second
        with override_env("TIERSAVE_LEFTOVER_GRACE_S", 1):
            ckpt.save(2, state).result()
    assert _kinds(s3_storage) == {}
    assert not [i.key for i in s3_storage.list(step_dirname(7))]
    with tiersave.Checkpointer(s3_storage) as ckpt:  # the checkpoints themselves are untouched
        assert [i.step for i in ckpt.list()] == [1, 2]
        assert torch.equal(ckpt.restore(2)["w"], state["w"])


@pytest.mark.parametrize("value", ["0", "soon", "-5"])
def test_a_bad_grace_is_a_config_error_naming_the_variable(value):
    from tiersave.knobs import leftover_grace_s

    with (
        override_env("TIERSAVE_LEFTOVER_GRACE_S", value),
        pytest.raises(ConfigError, match="TIERSAVE_LEFTOVER_GRACE_S"),
    ):
        leftover_grace_s()
