"""The checksums of the replicated state split among the ranks of one machine in a collective restore.

Every rank of a data-parallel job restores the whole replicated state, and the ranks sharing a machine read
its shards buffered, through that machine's one page cache (restore.py, "Reading it once per machine" in
docs/distributed.md): they read the same bytes of the same files. Checking every CRC-32C on every rank then
checks the same bytes once per rank. Here each replicated tensor is checked by one rank of the machine only,
the rank that wrote it where it is on this machine (the split the save used), and read unchecked by the others;
the restore's agreement at the end (one exchange the restore makes anyway) carries each rank's account of
what it read, and no rank applies the restored state before every rank of its machine has reported its share
verified. A rank whose share fails makes every rank fail naming the file, tensor, chunk and rank.

Where the premise cannot be confirmed, the rank checks the bytes it read unchecked itself, in memory, before
the restore completes: the ranks of a machine report the identity of each shared file (device, inode, size,
modification and change times, taken after reading) and a digest of the replicated tensors they read, and
any difference (another file under the same name, a partial restore that read other tensors, a rank that did
not split) sends every rank of that machine back to checking its own unchecked bytes, then through a second
agreement.

Scope: which replicated tensors this rank leaves to another rank of its machine, the document it sends in the
agreement, judging the gathered documents. Anti-scope: the reads and checks (engine/reader.py), the agreement
itself and the fallback to other copies (restore.py), which ranks share a machine (dist/identity.py).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .engine.reader import ReadRequest
from .knobs import int_env
from .replicated import REPLICATED_PREFIX
from .storage.posix.blobs import LocalBlobReader

if TYPE_CHECKING:  # pragma: no cover
    from .catalog import OpenCheckpoint
    from .dist import Json

_KNOB = "TIERSAVE_SPLIT_VERIFY"
"""``0``: every rank checks every chunk it reads (for a root on a network file system, whose page cache a
second read may bypass; see docs/guarantees.md)."""


def enabled() -> bool:
    """Whether the ranks of a machine split the checks of the replicated state (``TIERSAVE_SPLIT_VERIFY``)."""
    return int_env(_KNOB, 1, 0, 1) == 1


@dataclass
class Split:
    """This rank's part of the split: the requests it reads unchecked and the files they come from.

    Attributes:
        node: the ranks of this machine, ascending; the replicated tensor written by rank ``w`` is checked by
            ``node[w % len(node)]`` (``w`` itself when it is on this machine).
        files: the shared shards read through the page cache, by index.
        unchecked: the requests read with ``verify=False``.
        names: every replicated tensor of those shards this rank reads, checked or not.
    """

    node: list[int]
    files: dict[int, LocalBlobReader]
    unchecked: list[ReadRequest] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    doc: Json = None

    @property
    def unchecked_bytes(self) -> int:
        return sum(req.entry.nbytes for req in self.unchecked)

    def document(self) -> Json:
        """What this rank tells the others after reading (taken by :meth:`close`, while the files are open)."""
        return self.doc

    def close(self) -> None:
        """After the reads, before the files close: record this machine's ranks, the identity of each shared
        file as it stands now, and a digest of the replicated tensors read, for :meth:`document`."""
        files: dict[str, Json] = {}
        for shard, reader in sorted(self.files.items()):
            st = os.fstat(reader.fileno())
            files[str(shard)] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        digest = hashlib.blake2b("\n".join(sorted(self.names)).encode(), digest_size=16).hexdigest()
        self.doc = {"node": list(self.node), "files": files, "names": digest}


def plan(ckpt: OpenCheckpoint, requests: Sequence[ReadRequest], rank: int, node: Sequence[int]) -> Split | None:
    """Mark the requests of replicated tensors that another rank of ``node`` (this machine's ranks) checks:
    ``verify=False``. None (every request checked here) when this rank is alone on its machine, the split is
    off, or no shard qualifies: a shard qualifies when every rank of the machine reads it buffered from one
    local file (``ckpt.shared``: the storage opens it with ``open_shared_reader``; a plain, uncompressed file
    on this machine, not a stream from a peer or an object store)."""
    ranks = sorted(node)
    if len(ranks) < 2 or rank not in ranks or not enabled() or not ckpt.shared:
        return None
    if getattr(ckpt.storage, "open_shared_reader", None) is None:
        return None
    files: dict[int, LocalBlobReader] = {}
    for shard in sorted(ckpt.shared.intersection(req.entry.shard for req in requests)):
        reader = ckpt.reader(shard)
        if isinstance(reader, LocalBlobReader):  # not a peer's stream nor a compressed shard's decoder
            files[shard] = reader
    if not files:
        return None
    split = Split(ranks, files)
    shards = ckpt.manifest.shards
    for req in requests:
        entry = req.entry
        if entry.shard not in files or not entry.name.startswith(REPLICATED_PREFIX):
            continue
        split.names.append(entry.name)
        writer = shards[entry.shard].rank
        if (writer if writer in ranks else ranks[writer % len(ranks)]) != rank:
            req.verify = False
            split.unchecked.append(req)
    return split


def holds(docs: Sequence[Json], rank: int) -> bool:
    """Whether ``rank``'s split was complete: every rank of its machine sent the same document (the same
    files, as the same inodes, unchanged, and the same replicated tensors read), so each tensor it left
    unchecked was checked by its checker. True for a rank that did not split."""
    mine = docs[rank]
    if not isinstance(mine, Mapping):
        return True
    node = mine.get("node")
    if not isinstance(node, list):
        return False
    return all(isinstance(r, int) and 0 <= r < len(docs) and docs[r] == mine for r in node)


def fallback_needed(docs: Sequence[Json]) -> bool:
    """Whether some rank's split did not hold: every rank computes the same answer from the same documents,
    so all of them go through the second agreement together."""
    return not all(holds(docs, r) for r in range(len(docs)))


def split_of(report: Any) -> Json:
    """The split document in a rank's agreement report (None: the rank did not split)."""
    return report.get("split") if isinstance(report, Mapping) else None
