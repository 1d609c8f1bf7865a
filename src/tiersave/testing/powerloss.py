"""Simulated power loss for a directory tree: what a machine would find on disk after a power cut.

Scope: :class:`PowerLossRecorder` follows one root while a test saves into it and keeps the *durable
image* the POSIX persistence model allows: a file's bytes as of its last ``fsync``, a directory's entries
(name -> inode) as of the directory's last ``fsync``. Every ``fsync`` (before and after) and every
acknowledgement the test marks is a *cut*; :meth:`PowerLossRecorder.materialize` writes the tree a
power cut at that instant could leave, into a fresh directory, for the checker to restore from. Like
SQLite's crash VFS (test6.c) and LevelDB's ``FaultInjectionTestEnv``, everything not yet fsynced is
dropped.

Level: the operating-system call. The recorder wraps ``os.fsync`` and ``os.fdatasync`` (the library's
only durability calls; a directory ``fsync`` too goes through ``os.fsync``) for descriptors under the
root, and reads what the descriptor's file or directory holds at that moment; writes, renames, links and
unlinks need no interception, since their effect becomes durable only with a later ``fsync`` of the file
or of its directory, where the recorder reads it. A wrapper at the ``Storage`` interface could not do
this: ``finish``, ``put`` and ``rename_prefix`` are durable as a whole there, so a missing ``fsync``
inside them would be invisible.

Two images per cut:

* ``"strict"``: directory entries as of each directory's last ``fsync`` and file bytes as of each
  file's last ``fsync`` (a file never fsynced is empty): everything not fsynced is lost.
* ``"metadata"``: every directory entry as it was at the cut (a rename, create or unlink reached the
  disk) but file bytes as of the last ``fsync``: the ext4 ``data=writeback`` worst case, where a name can
  outlive the data it names.

Anti-scope and limits: no partial persistence inside one file (unsynced bytes are dropped whole, never
torn at a sector or garbled), no reordering between two fsynced files, and a reused inode number is not
told apart from the file it replaced. Only ``os.fsync``/``os.fdatasync`` calls made by Python code are
seen (tiersave makes no others); ``O_SYNC`` writes, ``sync()`` and ``msync`` are not modelled.
Threads: the wrapped calls may come from any thread; the recorder serialises them.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Cut", "Entry", "PowerLossRecorder"]

Image = Literal["strict", "metadata"]

# An entry of a directory: (inode, "dir" | "file" | "other").
Entry = tuple[int, str]


@dataclass(frozen=True)
class Cut:
    """One instant a power cut could happen at.

    Attributes:
        index: position in the recording.
        label: what had just happened (``"after fsync step-.../shard-0"``, ``"ack 3"``).
        acked: the steps the test had marked acknowledged by then, in order.
        durable_dirs: each directory inode's entries as of its last ``fsync``.
        durable_files: each file inode's bytes as of its last ``fsync``.
        live_dirs: each reachable directory's entries at the cut (for the ``"metadata"`` image).
    """

    index: int
    label: str
    acked: tuple[int, ...]
    durable_dirs: dict[int, dict[str, Entry]]
    durable_files: dict[int, bytes]
    live_dirs: dict[int, dict[str, Entry]] = field(repr=False)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def _entries(fd_or_path: int | str) -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    try:
        with os.scandir(fd_or_path) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed by another thread while listing
                out[entry.name] = (st.st_ino, _kind(st.st_mode))
    except FileNotFoundError:
        pass
    return out


def _read_fd(fd: int) -> bytes:
    # A fresh, buffered descriptor on the same open file: the writer's may be write-only or O_DIRECT.
    rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(rfd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(rfd)


class PowerLossRecorder:
    """Records the durable image of the tree under ``root`` while installed (see the module docstring).

    Args:
        root: an existing directory; what it holds when the recorder is created counts as durable.
        max_file_bytes: refuse to record a larger file (the recorder keeps each fsynced file's bytes in
            memory; it is meant for small test states).

    Use as a context manager (or :meth:`install`/:meth:`uninstall`); call :meth:`mark_acked` right after a
    save the test treats as acknowledged returns.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_file_bytes: int = 64 << 20) -> None:
        self.root = Path(root).resolve()
        self.max_file_bytes = max_file_bytes
        st = os.stat(self.root)
        self._dev, self.root_ino = st.st_dev, st.st_ino
        self._lock = threading.RLock()
        self._dirs: dict[int, dict[str, Entry]] = {}
        self._files: dict[int, bytes] = {}
        self._acked: list[int] = []
        self.cuts: list[Cut] = []
        self.fsyncs = 0
        self._saved: tuple[Callable[[int], None], Callable[[int], None]] | None = None
        self._baseline(str(self.root))

    # -- recording --------------------------------------------------------------------------------

    def _baseline(self, path: str) -> None:
        entries = _entries(path)
        self._dirs[os.stat(path).st_ino] = entries
        for name, (ino, kind) in entries.items():
            child = os.path.join(path, name)
            if kind == "dir":
                self._baseline(child)
            elif kind == "file":
                with open(child, "rb") as f:
                    self._files[ino] = f.read()

    def _under_root(self, fd: int) -> bool:
        try:
            if os.fstat(fd).st_dev != self._dev:
                return False
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False
        return target == str(self.root) or target.startswith(str(self.root) + os.sep)

    def _live(self) -> dict[int, dict[str, Entry]]:
        out: dict[int, dict[str, Entry]] = {}
        stack = [(str(self.root), self.root_ino)]
        while stack:
            path, ino = stack.pop()
            entries = _entries(path)
            out[ino] = entries
            stack.extend((os.path.join(path, n), i) for n, (i, k) in entries.items() if k == "dir")
        return out

    def _cut(self, label: str) -> None:
        # The entry dicts are replaced, never mutated, so shallow copies are snapshots.
        self.cuts.append(
            Cut(len(self.cuts), label, tuple(self._acked), dict(self._dirs), dict(self._files), self._live())
        )

    def _record(self, fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            self._dirs[st.st_ino] = _entries(fd)
        elif stat.S_ISREG(st.st_mode):
            if st.st_size > self.max_file_bytes:
                raise ValueError(f"PowerLossRecorder: a {st.st_size}-byte file is over max_file_bytes")
            self._files[st.st_ino] = _read_fd(fd)

    def _wrap(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def durable(fd: int) -> None:
            if not isinstance(fd, int) or not self._under_root(fd):
                real(fd)
                return
            with self._lock:
                name = os.readlink(f"/proc/self/fd/{fd}")[len(str(self.root)) :] or "/"
                self._cut(f"before fsync {name}")
                real(fd)  # an error propagates; nothing became durable
                self.fsyncs += 1
                self._record(fd)
                self._cut(f"after fsync {name}")

        return durable

    def mark_acked(self, step: int) -> None:
        """The test saw ``step`` acknowledged (its save returned): a cut where it must be durable."""
        with self._lock:
            self._acked.append(step)
            self._cut(f"ack {step}")

    def install(self) -> None:
        if self._saved is not None:
            return
        self._saved = (os.fsync, os.fdatasync)
        module: Any = os  # the library looks ``os.fsync`` up at each call, so replacing it reaches every caller
        module.fsync = self._wrap(self._saved[0])
        module.fdatasync = self._wrap(self._saved[1])

    def uninstall(self) -> None:
        if self._saved is not None:
            module: Any = os
            module.fsync, module.fdatasync = self._saved
            self._saved = None

    def __enter__(self) -> PowerLossRecorder:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- after the cut ----------------------------------------------------------------------------

    def materialize(self, cut: Cut, dest: str | os.PathLike[str], image: Image = "strict") -> Path:
        """Write the tree a power cut at ``cut`` could leave into ``dest`` (created; must not exist)."""
        if image not in ("strict", "metadata"):
            raise ValueError(f"image must be 'strict' or 'metadata', got {image!r}")
        dirs = cut.durable_dirs if image == "strict" else cut.live_dirs
        out = Path(dest)
        out.mkdir(parents=True)
        for rel, kind, ino in self._walk(dirs, self.root_ino, ""):
            path = out / rel
            if kind == "dir":
                path.mkdir()
            else:
                path.write_bytes(cut.durable_files.get(ino, b""))
        return out

    def _walk(self, dirs: dict[int, dict[str, Entry]], ino: int, prefix: str) -> Iterator[tuple[str, str, int]]:
        for name, (child, kind) in sorted(dirs.get(ino, {}).items()):
            rel = f"{prefix}{name}"
            if kind == "dir":
                yield rel, kind, child
                yield from self._walk(dirs, child, rel + "/")
            elif kind == "file":
                yield rel, kind, child


@contextmanager
def recording(root: str | os.PathLike[str]) -> Iterator[PowerLossRecorder]:
    """``with recording(root) as rec:``: a :class:`PowerLossRecorder` installed for the block."""
    rec = PowerLossRecorder(root)
    with rec:
        yield rec
