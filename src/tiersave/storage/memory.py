"""The memory tier: checkpoints in shared memory (``/dev/shm``) on this node, ``mem://NAME``.

Scope: a :class:`~tiersave.storage.posix.LocalStorage` rooted at ``/dev/shm/tiersave-<uid>/NAME`` (tmpfs), so
the same atomic-rename commit applies and a checkpoint there outlives the process that wrote it: after a
crash, a new process on the same node restores from RAM instead of disk. It does not survive a reboot or
the loss of the node (``capabilities.durable`` is False), so a chain drains it to a durable tier.
Anti-scope: peer (other-node) memory, retention decisions (``tiersave.policy``).

Nothing leaks: retention deletes whole checkpoints; the temporary directory of a save killed midway is a
leftover that ``Catalog.clean_leftovers`` removes once its process is dead (same host, so this is always
known); :meth:`MemoryStorage.destroy` removes the whole namespace, and :func:`namespaces` lists what
exists on this node with its size.

The base directory is ``TIERSAVE_SHM_DIR`` if set (tests, or a host whose tmpfs is elsewhere), else
``/dev/shm/tiersave-<uid>``: one per user, created with mode 0700. On a node shared by several users it
must be private: a base that is a link, is owned by another user or is writable by group or others is
refused with a :class:`ConfigError` (:func:`~tiersave.storage.posix.trust.check_private_dir`), since whoever
can write there could delete or replace checkpoints or plant links. Everything under it is then opened
with the same link and special-file rules as a local root.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, storage_error_from_os
from .posix import LocalStorage
from .posix.trust import check_private_dir

__all__ = ["MemoryNamespace", "MemoryStorage", "namespaces", "shm_base"]

_SHM_ENV = "TIERSAVE_SHM_DIR"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def shm_base() -> Path:
    """The directory holding this user's memory-tier namespaces on this node (``/dev/shm/tiersave-<uid>``)."""
    return Path(os.environ.get(_SHM_ENV) or f"/dev/shm/tiersave-{os.geteuid()}")


def _check_base(base: Path) -> None:
    check_private_dir(
        base,
        what="memory-tier directory",
        fix=f"Remove it (if it is not yours, ask its owner or an administrator) or point {_SHM_ENV} at a "
        "private directory on a tmpfs.",
    )


def check_name(name: str) -> str:
    """Validate a namespace name: one or more safe components separated by ``/`` (no ``..``)."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or not all(_NAME_RE.match(p) and p not in (".", "..") for p in parts):
        raise ConfigError(f"invalid memory-tier name {name!r}: use letters, digits, '.', '_', '-' (and '/')")
    return name


class MemoryStorage(LocalStorage):
    """Shared memory on this node (``mem://NAME``). Same protocol and atomicity as LocalStorage.

    Args:
        name: the namespace, e.g. the run's name; ``mem://run1`` and ``MemoryStorage("run1")`` are the same.
        create: create a missing namespace (False: raise ``ObjectNotFoundError``).

    Thread safety: as LocalStorage. Readers use ``pread`` on tmpfs, a memory copy.
    """

    def __init__(self, name: str, *, create: bool = True) -> None:
        self.name = check_name(name)
        base = shm_base()
        if create:
            try:
                base.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                raise storage_error_from_os(exc, tier=f"mem://{name}", key="", action="creating") from None
        if create or os.path.lexists(base):
            _check_base(base)  # before anything is created or read under it
        # tmpfs: direct I/O buys nothing (there is no device), whatever TIERSAVE_IO says
        super().__init__(base.joinpath(*name.split("/")), create=create, io="buffered")
        self.uri = f"mem://{name}"

    def __repr__(self) -> str:
        return f"MemoryStorage({self.name!r}, root={str(self.root)!r})"

    def used_bytes(self) -> int:
        """Bytes of every file in this namespace (committed checkpoints and leftovers)."""
        return _tree_bytes(self.root)

    def destroy(self) -> None:
        """Remove the whole namespace from shared memory. The storage must not be used afterwards."""
        try:
            shutil.rmtree(self.root)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error_from_os(exc, tier=self.uri, key="", action="removing") from None


@dataclass(frozen=True)
class MemoryNamespace:
    """One memory-tier namespace on this node: its URI and the bytes it holds."""

    uri: str
    path: str
    bytes: int


def namespaces() -> list[MemoryNamespace]:
    """Every top-level memory-tier namespace on this node, with its size (to find what holds RAM)."""
    base = shm_base()
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [
        MemoryNamespace(f"mem://{e.name}", e.path, _tree_bytes(Path(e.path)))
        for e in entries
        if e.is_dir(follow_symlinks=False)
    ]


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total
