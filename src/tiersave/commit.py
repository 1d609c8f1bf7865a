"""How a checkpoint becomes visible: the commit strategies (docs/format.md section 6).

``RenameCommit`` (file systems with atomic rename): data goes to ``step-N.tmp-<token>/``; the manifest
is written last, durably, inside it; the directory is renamed to ``step-N`` without replacing one that
exists, and the root is fsynced. A crash at any instant leaves either the old set of committed
checkpoints or the old set plus the new one, never a partial checkpoint under a committed name.

Call protocol (one save, one thread): ``begin(step)`` -> write shards under the returned prefix ->
``commit(prefix, step, manifest)`` or ``abort(prefix)``.
"""

from __future__ import annotations

import os
import socket
import zlib

from ._crash import crashpoint
from .errors import AlreadyExistsError, ConfigError
from .format.layout import MANIFEST_NAME, new_token, step_dirname, tmp_dirname
from .storage.base import Storage


def _host_id() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def tmp_token() -> str:
    """``<pid>-<host id>-<random>``: lets ``prune`` tell a live save's directory from a dead one's."""
    return f"{os.getpid()}-{_host_id()}-{new_token()}"


def parse_tmp_owner(name: str) -> tuple[int, str] | None:
    """The (pid, host id) that created a temporary directory, if its token has that form."""
    token = name.partition(".tmp-")[2]
    parts = token.split("-")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1]


def owner_alive(name: str) -> bool | None:
    """True/False if the creator of ``name`` is known to be alive/dead on this host; None if unknown."""
    owner = parse_tmp_owner(name)
    if owner is None or owner[1] != _host_id():
        return None
    try:
        os.kill(owner[0], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RenameCommit:
    """Commit by renaming a fully written temporary directory into place."""

    def __init__(self, storage: Storage) -> None:
        if not storage.capabilities.atomic_rename:
            raise ConfigError(f"{storage.uri} has no atomic rename; it needs a marker commit")
        self.storage = storage

    def begin(self, step: int) -> str:
        final = step_dirname(step)
        if self.storage.exists(f"{final}/{MANIFEST_NAME}"):
            raise AlreadyExistsError(
                f"step {step} is already committed in {self.storage.uri}; a checkpoint is never "
                "overwritten: delete it first (tiersave prune) or save under another step",
                tier=self.storage.uri,
                key=final,
            )
        crashpoint("save_begin")
        return tmp_dirname(step, tmp_token())

    def commit(self, prefix: str, step: int, manifest: bytes) -> str:
        self.storage.put(f"{prefix}/{MANIFEST_NAME}", manifest, mode="create")  # fsyncs file and directory
        crashpoint("after_manifest")
        final = step_dirname(step)
        self.storage.rename_prefix(prefix, final)  # no-replace rename, then fsync of the root
        crashpoint("after_commit")
        return final

    def abort(self, prefix: str) -> None:
        self.storage.delete_prefix(prefix)
