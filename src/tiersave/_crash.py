"""White-box crash points for the crash-consistency tests.

``crashpoint("after_manifest")`` is a no-op unless ``TIERSAVE_CRASHPOINT`` names that point, as
``name`` (first hit) or ``name:k`` (k-th hit, 1-based); then the process kills itself with SIGKILL, the
way a power cut or the OOM killer would stop it, with no cleanup. ``CRASHPOINTS`` lists every point so a
test can assert that each one was reached.
"""

from __future__ import annotations

import os
import signal

CRASHPOINTS = (
    "save_begin",  # before anything is written
    "after_shard_write",  # shard bytes written, not yet fsynced
    "after_shard_fsync",  # every shard durable, no manifest yet
    "after_manifest",  # manifest durable in the temporary directory, not yet renamed
    "after_rename",  # renamed into place, parent directory not yet fsynced
    "after_commit",  # fully committed, before retention and acknowledgement
)

_hits: dict[str, int] = {}


def crashpoint(name: str) -> None:
    spec = os.environ.get("TIERSAVE_CRASHPOINT")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == (int(nth) if nth else 1):
        os.kill(os.getpid(), signal.SIGKILL)
