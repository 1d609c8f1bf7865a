"""tiersave as a ``torch.distributed.checkpoint`` (DCP) backend: ``dcp.save`` / ``dcp.async_save`` /
``dcp.load`` on tiersave storage (a path, ``mem://NAME``, ``s3://bucket/prefix``).

A DCP save through :class:`Writer` is a normal tiersave checkpoint: one committed step (atomic commit),
one 4 KiB-aligned shard per rank with CRC-32C per chunk, DCP's metadata stored as JSON in the manifest
(never pickled), so ``tiersave ls / inspect / verify`` see it. :class:`Reader` validates it strictly and
verifies every byte it hands back; resharding onto another world size comes from DCP. See docs/dcp.md.

Scope: the StorageWriter/StorageReader pair and the JSON encoding of DCP's metadata.
Anti-scope: DCP's planning and resharding, the native Checkpointer, retention, the CLI.
"""

from .reader import Reader
from .writer import Writer

__all__ = ["Reader", "Writer"]
