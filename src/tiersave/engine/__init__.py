"""Parallel, checksummed movement of tensor bytes between memory and a storage backend.

Scope: splitting tensors into chunks, running reads and writes on a thread pool (the system calls and
CRC-32C release the GIL), computing and verifying checksums. Anti-scope: what a checkpoint contains
(format/, state.py), when it becomes visible (commit.py).
"""
