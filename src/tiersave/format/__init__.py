"""The v1 checkpoint format: dtypes, layout rules, checksums, the manifest and the state-tree encoding.

Scope: pure data definitions, serialization and validation (docs/format.md is the normative spec).
Anti-scope: I/O (storage/), torch objects (state.py), scheduling of reads and writes (engine/).
Nothing here imports torch, numpy or the storage layer.
"""

FORMAT_NAME = "tiersave"
FORMAT_VERSION = (1, 1)
FORMAT_VERSION_STR = f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}"
