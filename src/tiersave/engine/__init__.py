"""Parallel, checksummed movement of tensor bytes between a state and the ``Storage`` protocol.

Modules: ``stage`` (the staging arena, its ring, host and device copies), ``memcopy`` (the streaming copy
for large host copies, a small C routine built at install, or ``memmove``), ``pipeline`` (the staged write of
one save: layout, units, checksums, parallel writes, durability), ``reader`` (parallel verified reads into
caller memory), ``pool`` (daemon thread pools), ``ordering`` (what a staged write asks of writers with an upload
window).

Scope: splitting tensors into chunks, staging them, running reads and writes on a thread pool (the system
calls and CRC-32C release the GIL), computing and verifying checksums. Anti-scope: what a checkpoint
contains (format/, state.py), when it becomes visible (commit.py), catalogs and tiers (the checkpoint
level), file-system and object-store details (storage/).
"""
