"""tiersave as a ``torch.distributed.checkpoint`` (DCP) backend: ``dcp.save`` / ``dcp.async_save`` /
``dcp.load`` on tiersave storage (a path, ``mem://NAME``, ``s3://bucket/prefix``).

A DCP save through :class:`Writer` is a normal tiersave checkpoint: one committed step (atomic commit),
one 4 KiB-aligned shard per rank with CRC-32C per chunk, DCP's metadata stored as JSON in the manifest
(never pickled), so ``tiersave ls / inspect / verify`` see it. :class:`Reader` validates it strictly and
verifies every byte it hands back; resharding onto another world size comes from DCP. See docs/dcp.md.

:func:`export_safetensors` consolidates the sharded tensors into one safetensors file.

Scope: the StorageWriter/StorageReader pair, the JSON encoding of DCP's metadata, consolidation.
Anti-scope: DCP's planning and resharding, the native Checkpointer, retention, the CLI.
"""

from .export import ExportSummary, export_safetensors
from .reader import Reader
from .writer import Writer

__all__ = ["ExportSummary", "Reader", "Writer", "export_safetensors"]
