"""The checkpoint format (1.x, 2.0 with shard references, 3.0 with compressed shards, 4.0 with the compact
tensor table, 5.0 with an optimizer's state as one run): dtypes, layout rules, checksums, the manifest and the
state-tree encoding.

Scope: pure data definitions, serialization and validation (docs/format.md is the normative spec).
Anti-scope: I/O (storage/), torch objects (state.py), scheduling of reads and writes (engine/).
Nothing here imports torch, numpy or the storage layer.
"""

FORMAT_NAME = "tiersave"
FORMAT_VERSION = (1, 1)
"""The version of a plain checkpoint (no content hashes, no references): every 1.x reader reads it."""
FORMAT_VERSION_STR = f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}"
HASHED_VERSION_STR = "1.2"
"""Shards carry content hashes (docs/format.md section 9), which 1.1 readers ignore."""
REFERENCE_VERSION_STR = "2.0"
"""A shard is a reference to an earlier step's shard: 1.x readers must refuse it."""
ENCODED_VERSION_STR = "3.0"
"""A shard is stored compressed (docs/format.md section 10): 1.x and 2.x readers must refuse it."""
COMPACT_VERSION_STR = "4.0"
"""The tensor table is stored as columns (docs/format.md section 4.4): readers before 4.0 must refuse it."""
DICT_RUN_VERSION_STR = "5.0"
"""A compact manifest whose tree holds a ``$dictruns`` (docs/format.md section 4.4): readers before 5.0 must
refuse it (a new tree tag)."""
READ_VERSIONS = {1: 3, 2: 1, 3: 1, 4: 1, 5: 1}
"""The majors this reader reads, each with the newest minor whose fields it knows."""
CONTENT_HASHES = ("sha256", "blake3")
"""The hash functions of shard pieces (docs/format.md section 9), the first the default. A manifest whose
pieces use another names it in ``checksum.content`` and is one minor version up (1.3, 2.1, 3.1): readers of
the minor before ignore the field, which is safe because content hashes only decide what a later
incremental save may reference, and digests of two different functions never match."""
NAMED_HASH_MINOR = {1: 3, 2: 1, 3: 1, 4: 1, 5: 1}
"""Per major, the first minor version that may carry ``checksum.content``."""
