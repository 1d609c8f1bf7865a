"""The manifest: the one JSON document that describes a checkpoint and whose presence commits it.

``Manifest.to_json()`` writes docs/format.md section 4; ``Manifest.parse()`` performs every check of
section 4.2 before any value is used, so code holding a ``Manifest`` can trust its offsets and sizes.

Integrity (format 1.1): ``checksum.manifest_sha256`` is the SHA-256 of the manifest's canonical bytes
without that field (:func:`seal`). It is checked right after the JSON is parsed, before any value is used,
so a flipped bit in a scalar, a string, a dtype or a tensor reference is caught like a flipped bit in a
shard. It detects damage, not forgery: whoever can rewrite a manifest can recompute its hash.

Content hashes (1.2) and shard references (2.0), docs/format.md section 9: a shard may carry the SHA-256
(or, named in ``checksum.content``, the BLAKE3: 1.3, 2.1, 3.1) of its pieces (``ShardInfo.content``) and
may live in an earlier step's directory (``ShardInfo.step``). The version written follows from what the
shards use (:func:`version_for`), so a plain checkpoint stays 1.1.

The compact table (4.0, docs/format.md 4.4, ``format/compact.py``): columns and tree runs
(``format/treeruns.py``; 5.0 when an optimizer's state is one ``$dictruns``) from
``compact.COMPACT_MIN_TENSORS`` tensors; parsed, both encodings give the same ``Manifest``. The seal:
``format/sealing.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import itertools
import math
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from .._version import __version__
from ..errors import CorruptCheckpointError, FormatError, UnsupportedFormatVersionError
from . import (
    COMPACT_VERSION_STR,
    CONTENT_HASHES,
    DICT_RUN_VERSION_STR,
    ENCODED_VERSION_STR,
    FORMAT_NAME,
    FORMAT_VERSION_STR,
    HASHED_VERSION_STR,
    NAMED_HASH_MINOR,
    READ_VERSIONS,
    REFERENCE_VERSION_STR,
)
from . import compact as _compact
from .checksum import ALGORITHM, chunk_count
from .columns import Columns, first_range_fault, ranges_ok, tensor_columns
from .compact import TableDecoder, encode_table, entry_table
from .dtypes import lookup
from .encoding import Encoding, parse_encoding
from .jsonsafe import check_depth, is_finite_number, loads_strict, paused_gc
from .layout import ALIGN, MAX_CHUNK_BYTES, MAX_MANIFEST_BYTES, MAX_STEP, is_safe_file, is_valid_tag, step_dirname
from .sealing import MANIFEST_HASH_FIELD as MANIFEST_HASH_FIELD  # re-exported: the field's name
from .sealing import SHA256_HEX, VERSION_RE, check_seal
from .sealing import seal as seal  # re-exported: writers and tests seal documents through this module
from .tree import validate_tree
from .treeruns import TreeRuns, compress_tree
from .view import RankPart, check_runs_inside, select_rows, shared_names, subtree

_MAX_INT = (1 << 63) - 1
_MAX_NDIM = 64
_MAX_NAME = 1024
_HEX8 = re.compile(r"\A[0-9a-f]{8}\Z")  # \Z: "$" would let a trailing newline through

_TOP_FIELDS = frozenset(
    {
        "format",
        "format_version",
        "step",
        "created_at",
        "world_size",
        "library",
        "checksum",
        "shards",
        "tensors",
        "tree",
        "metrics",
        "tags",
        "metadata",
        "stats",
    }
)
_SHARD_FIELDS = frozenset({"file", "rank", "size"})
_SHARD_FIELDS_1_2 = _SHARD_FIELDS | {"content"}
_SHARD_FIELDS_2_0 = _SHARD_FIELDS_1_2 | {"step"}
_SHARD_FIELDS_3_0 = _SHARD_FIELDS_2_0 | {"encoding"}
_CHECKSUM_FIELDS = frozenset({"algorithm", "chunk_bytes"})
_TENSOR_FIELDS = frozenset({"dtype", "shape", "shard", "offset", "nbytes", "crc32c"})


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard file of a checkpoint.

    ``content`` is the shard cut into pieces, each ``(length, hex digest)`` by the manifest's ``content_hash``
    (empty: not hashed).
    ``step`` is None for a shard in the checkpoint's own directory, else the earlier step whose directory
    holds ``file`` (a reference, format 2.0). ``encoding`` is None for a shard stored as its decoded bytes,
    else how its frames are stored (format 3.0); ``size`` is always the decoded size.
    """

    file: str
    rank: int
    size: int
    content: tuple[tuple[int, str], ...] = ()
    step: int | None = None
    encoding: Encoding | None = None

    @property
    def stored_size(self) -> int:
        """Bytes of the shard's file on its tier."""
        return self.encoding.stored_size if self.encoding is not None else self.size

    @property
    def is_reference(self) -> bool:
        return self.step is not None

    def key(self, own_dir: str) -> str:
        """The shard's key from the root, given the directory (``step-N``) of the checkpoint naming it."""
        return f"{step_dirname(self.step)}/{self.file}" if self.step is not None else f"{own_dir}/{self.file}"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"file": self.file, "rank": self.rank, "size": self.size}
        if self.content:
            doc["content"] = [[n, h] for n, h in self.content]
        if self.step is not None:
            doc["step"] = self.step
        if self.encoding is not None:
            doc["encoding"] = self.encoding.to_json()
        return doc


def version_for(
    shards: tuple[ShardInfo, ...],
    current: str = FORMAT_VERSION_STR,
    content_hash: str = CONTENT_HASHES[0],
    compact: bool = False,
    dict_runs: bool = False,
) -> str:
    """The format version a manifest with these shards is written as: the lowest that describes them: 5.0
    with the compact table and a ``$dictruns`` in the tree, 4.0 with the compact table, 3.0 with a compressed
    shard, 2.0 with a reference, 1.2 with content hashes, else
    ``current`` (a 1.x version; the one it was read as) or 1.1. Content hashes by another function than
    SHA-256 (``content_hash``) make it the next minor version: 5.1, 4.1, 3.1, 2.1, 1.3."""
    if dict_runs:
        version = DICT_RUN_VERSION_STR
    elif compact:
        version = COMPACT_VERSION_STR
    elif any(s.encoding is not None for s in shards):
        version = ENCODED_VERSION_STR
    elif any(s.step is not None for s in shards):
        version = REFERENCE_VERSION_STR
    elif any(s.content for s in shards):
        version = HASHED_VERSION_STR
    else:
        return current if current.startswith("1.") else FORMAT_VERSION_STR
    if content_hash != CONTENT_HASHES[0] and any(s.content for s in shards):
        major = int(version.split(".")[0])
        return f"{major}.{NAMED_HASH_MINOR[major]}"
    return version


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes live and how to check them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int
    offset: int
    nbytes: int
    crc32c: tuple[str, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_ENTRY_SLOTS = tuple(TensorEntry.__dict__[f.name] for f in dataclasses.fields(TensorEntry))


def entries_from_columns(columns: Columns) -> list[TensorEntry]:
    """``list(map(TensorEntry, *columns))``, about twice as fast: a frozen dataclass's ``__init__`` sets each
    field through ``object.__setattr__`` in Python; here each slot is filled for all entries by one ``map``
    in C. The values were checked by ``tensor_columns``; every field is set, as ``__init__`` would."""
    entries = list(map(object.__new__, itertools.repeat(TensorEntry, len(columns[0]))))
    for slot, values in zip(_ENTRY_SLOTS, cast("tuple[list[Any], ...]", columns), strict=True):
        collections.deque(map(slot.__set__, entries, values), maxlen=0)
    return entries


def utc_now_rfc3339() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest (or one being built by a writer)."""

    step: int
    shards: tuple[ShardInfo, ...]
    tensors: Mapping[str, TensorEntry]
    tree: Any
    world_size: int = 1
    chunk_bytes: int = MAX_CHUNK_BYTES
    created_at: str = field(default_factory=utc_now_rfc3339)
    metrics: Mapping[str, float] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    stats: Mapping[str, Any] = field(default_factory=dict)
    format_version: str = FORMAT_VERSION_STR
    library: Mapping[str, Any] = field(default_factory=lambda: {"name": "tiersave", "version": __version__})
    content_hash: str = CONTENT_HASHES[0]
    """The hash function of the shards' ``content`` pieces (``checksum.content``; SHA-256 when absent)."""
    manifest_verified: bool = True
    """False for a manifest written before format 1.1, which carries no checksum of its own."""
    part: int | None = None
    """The rank whose view this is (``parse(..., part=)``, format/view.py): ``tree`` is its subtree and
    ``tensors`` its own and the replicated ones. None: the whole checkpoint. A view is never written."""

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def stored_bytes(self) -> int:
        """Bytes of shard files, padding included."""
        return sum(s.size for s in self.shards)

    @property
    def file_bytes(self) -> int:
        """Bytes of the shard files as stored on the tier: ``stored_bytes`` unless shards are compressed."""
        return sum(s.stored_size for s in self.shards)

    @property
    def referenced_bytes(self) -> int:
        """Bytes of the shards that are references to an earlier step's shards (not written by this save)."""
        return sum(s.size for s in self.shards if s.step is not None)

    @property
    def referenced_steps(self) -> frozenset[int]:
        """The earlier steps whose directories hold shards of this checkpoint."""
        return frozenset(s.step for s in self.shards if s.step is not None)

    def to_json(self) -> bytes:
        """Serialize; the result parses back to an equal manifest."""
        with paused_gc():
            return self._to_json()

    def _to_json(self) -> bytes:
        if self.part is not None:
            raise FormatError(f"step {self.step}: rank {self.part}'s view of a manifest cannot be written")
        names, entries = list(self.tensors), list(self.tensors.values())
        compact = len(names) >= _compact.COMPACT_MIN_TENSORS  # docs/format.md 4.4: columns, format 4.x / 5.x
        tree, runs = compress_tree(self.tree, names) if compact else (self.tree, False)
        doc = {
            "format": FORMAT_NAME,
            "format_version": version_for(self.shards, self.format_version, self.content_hash, compact, runs),
            "step": self.step,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "library": dict(self.library),
            "checksum": self._checksum_doc(),
            "shards": [s.to_json() for s in self.shards],
            ("table" if compact else "tensors"): (encode_table if compact else entry_table)(names, entries),
            "tree": tree,
            "metrics": dict(self.metrics),
            "tags": list(self.tags),
            "metadata": dict(self.metadata),
            "stats": dict(self.stats),
        }
        data = seal(doc)
        if len(data) > MAX_MANIFEST_BYTES:
            raise FormatError(
                f"manifest of step {self.step} would be {len(data)} bytes, over the "
                f"{MAX_MANIFEST_BYTES}-byte limit; keep large values in tensors, not in metadata"
            )
        return data

    def _checksum_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"algorithm": ALGORITHM, "chunk_bytes": self.chunk_bytes}
        if self.content_hash != CONTENT_HASHES[0] and any(s.content for s in self.shards):
            doc["content"] = self.content_hash  # absent: SHA-256, so 1.2 and 2.0 manifests stay as they were
        return doc

    def validate(self, *, path: str = "") -> None:
        """Run the structural checks of docs/format.md 4.2 (steps 4-8) on this manifest."""
        _Checker(path or f"step {self.step}").check_manifest(self)

    @classmethod
    def parse(cls, data: bytes, *, path: str, expect_step: int | None = None, part: RankPart | None = None) -> Manifest:
        """Parse and fully validate manifest bytes read from ``path``.

        ``part``: of a checkpoint of several ranks, build only that rank's view (format/view.py; the whole
        document is still sealed and its table checked row by row); of any other, the whole manifest.

        Raises:
            FormatError: not a valid v1 manifest.
            UnsupportedFormatVersionError: a major version this reader does not know.
            CorruptCheckpointError: the manifest contradicts where it was found (``expect_step``).
        """
        with paused_gc():
            return cls._parse(data, path=path, expect_step=expect_step, part=part)

    @classmethod
    def _parse(cls, data: bytes, *, path: str, expect_step: int | None, part: RankPart | None) -> Manifest:
        # Table depths: checked by _Checker.tensors (10^5 entries: a tenth of the parse), implied by TableDecoder
        # A view's tree depth too: only the subtree it walks is checked (build)
        defer = ("tensors", "table", "tree") if part is not None else ("tensors", "table")
        doc = loads_strict(data, what=path, max_bytes=MAX_MANIFEST_BYTES, defer_depth=defer)
        try:
            verified = check_seal(doc, path, data)
            manifest = _Checker(path, part).build(doc)
        except RecursionError:  # cannot happen within the caps; a typed error if the stack was already deep
            raise FormatError(f"{path}: nested too deeply to validate", path=path) from None
        if not verified:
            manifest = dataclasses.replace(manifest, manifest_verified=False)
        if expect_step is not None and manifest.step != expect_step:
            raise CorruptCheckpointError(
                f"{path}: manifest says step {manifest.step} but was found as step {expect_step}",
                path=path,
                step=expect_step,
                file="manifest.json",
            )
        return manifest


class _Checker:
    """Validation with messages that name the manifest and the field."""

    def __init__(self, path: str, part: RankPart | None = None) -> None:
        self.path = path
        self.part = part
        self.entries: list[TensorEntry] | None = None  # the per-entry table's entries, before a view filters them
        self.tree_depth = 0
        self.strict_fields = True
        self.shard_fields = _SHARD_FIELDS
        self.checksum_fields = _CHECKSUM_FIELDS
        self.columns: Columns | None = None
        self.top_fields = _TOP_FIELDS
        self.tree_checked = False
        self.dict_runs = False

    def fail(self, message: str) -> FormatError:
        return FormatError(f"{self.path}: {message}", path=self.path)

    def int_field(self, value: Any, what: str, *, lo: int = 0, hi: int = _MAX_INT) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(f"{what} must be an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise self.fail(f"{what} = {value} is out of range [{lo}, {hi}]")
        return value

    def fields(self, obj: Any, allowed: frozenset[str], required: frozenset[str], what: str) -> dict[str, Any]:
        if not isinstance(obj, dict):
            raise self.fail(f"{what} must be an object")
        missing = required - obj.keys()
        if missing:
            raise self.fail(f"{what} lacks field(s) {', '.join(sorted(missing))}")
        unknown = obj.keys() - allowed
        if unknown and self.strict_fields:
            raise self.fail(f"{what} has unknown field(s) {', '.join(sorted(unknown))}")
        return obj

    def version(self, doc: dict[str, Any]) -> str:
        if doc.get("format") != FORMAT_NAME:
            raise self.fail(f"not a tiersave manifest (format = {doc.get('format')!r})")
        version = doc.get("format_version")
        m = VERSION_RE.match(version) if isinstance(version, str) else None
        if m is None:
            raise self.fail(f"format_version {version!r} is not MAJOR.MINOR")
        major, minor = int(m.group(1)), int(m.group(2))
        known = READ_VERSIONS.get(major)
        if known is None:
            majors = sorted(READ_VERSIONS)
            names = " and ".join([", ".join(f"{v}.x" for v in majors[:-1]), f"{majors[-1]}.x"][-len(majors) :])
            raise UnsupportedFormatVersionError(
                f"{self.path}: written with format version {version}; this tiersave ({__version__}) "
                f"reads {names} only. " + ("Upgrade tiersave to read it." if major > majors[-1] else ""),
                path=self.path,
            )
        # A newer minor version may add fields we may ignore; an older or equal one may not surprise us.
        self.strict_fields = minor <= known
        self.dict_runs = major >= 5
        if major >= 4:
            self.top_fields = _TOP_FIELDS - {"tensors"} | {"table"}
        if major >= 3:
            self.shard_fields = _SHARD_FIELDS_3_0
        elif major == 2:
            self.shard_fields = _SHARD_FIELDS_2_0
        elif minor >= 2:
            self.shard_fields = _SHARD_FIELDS_1_2
        if minor >= NAMED_HASH_MINOR.get(major, minor + 1):
            self.checksum_fields = _CHECKSUM_FIELDS | {"content"}
        return m.group(0)

    def build(self, doc: Any) -> Manifest:
        if not isinstance(doc, dict):
            raise self.fail("manifest must be a JSON object")
        version = self.version(doc)
        self.fields(doc, self.top_fields, self.top_fields - {"stats", "metadata"}, "manifest")
        step = self.int_field(doc["step"], "step", hi=MAX_STEP)
        created_at = doc["created_at"]
        if not isinstance(created_at, str) or len(created_at) > 64:
            raise self.fail("created_at must be a short string")
        checksum = self.fields(doc["checksum"], self.checksum_fields, _CHECKSUM_FIELDS, "checksum")
        if checksum["algorithm"] != ALGORITHM:
            raise self.fail(f"checksum algorithm {checksum['algorithm']!r} is not supported (only crc32c)")
        chunk_bytes = self.int_field(checksum["chunk_bytes"], "checksum.chunk_bytes", lo=ALIGN, hi=MAX_CHUNK_BYTES)
        if chunk_bytes % ALIGN:
            raise self.fail(f"checksum.chunk_bytes {chunk_bytes} is not a multiple of {ALIGN}")
        content_hash = checksum.get("content", CONTENT_HASHES[0])  # a field only allowed from 1.3, 2.1, 3.1
        if content_hash not in CONTENT_HASHES:
            names = ", ".join(CONTENT_HASHES)
            raise self.fail(f"checksum.content {content_hash!r} is not a content hash this reader knows ({names})")
        world_size = self.int_field(doc["world_size"], "world_size", lo=1, hi=1 << 24)
        library = doc["library"]
        if not isinstance(library, dict):
            raise self.fail("library must be an object")

        if not isinstance(doc["shards"], list):
            raise self.fail("shards must be an array")
        shards = [self.shard(i, raw, world_size, step, chunk_bytes) for i, raw in enumerate(doc["shards"])]

        part = self.part if self.part is not None and self.part.applies(world_size) else None
        self.tree_depth = 0 if part is None else 1  # a rank's subtree lies one level down in the whole tree
        tree = doc["tree"] if part is None else subtree(doc["tree"], part, self.fail)
        if self.part is not None:  # loads_strict left the tree's depth to here (a subtree is at level 3)
            check_depth(tree, what=self.path, start=2 if part is None else 3)
        if "table" in self.top_fields:
            self.columns = TableDecoder(self.fail, max_ndim=_MAX_NDIM, max_name=_MAX_NAME, max_int=_MAX_INT).decode(
                doc["table"], len(shards), chunk_bytes, strict=self.strict_fields
            )
            kept = self.columns if part is None else select_rows(self.columns, part)
            tensors = dict(zip(kept[0], entries_from_columns(kept), strict=True))
            runs = TreeRuns(tree, self.columns[0], self.fail, dict_runs=self.dict_runs)
            referenced = runs.referenced()
            if part is not None:  # the view's replicated tensors count as referenced: another rank may hold them
                check_runs_inside(referenced, tensors.keys(), part, self.fail)
                referenced += shared_names(kept[0], part)
            self.check_tree(runs.standins(), set(tensors), referenced)
            tree = runs.expand()
        else:
            tensors = self.tensors(doc["tensors"], len(shards), chunk_bytes)
            self.entries = list(tensors.values())  # every entry's byte range is checked (check_manifest)
            if part is not None:  # every entry was checked; the tree is the view's
                tensors = {name: t for name, t in tensors.items() if part.keeps(name)}
                self.check_tree(tree, set(tensors), shared_names(list(tensors), part))

        metrics = doc["metrics"]
        if not isinstance(metrics, dict) or not all(is_finite_number(v) for v in metrics.values()):
            raise self.fail("metrics must map names to finite numbers")
        tags = doc["tags"]
        if not isinstance(tags, list) or not all(isinstance(t, str) and is_valid_tag(t) for t in tags):
            raise self.fail("tags must be an array of names matching [A-Za-z0-9][A-Za-z0-9._-]*")
        if len(set(tags)) != len(tags):
            raise self.fail("tags must be unique")
        metadata = doc.get("metadata", {})
        stats = doc.get("stats", {})
        if not isinstance(metadata, dict) or not isinstance(stats, dict):
            raise self.fail("metadata and stats must be objects")

        manifest = Manifest(
            step=step,
            shards=tuple(shards),
            tensors=tensors,
            tree=tree,
            world_size=world_size,
            chunk_bytes=chunk_bytes,
            created_at=created_at,
            metrics=metrics,
            tags=tuple(tags),
            metadata=metadata,
            stats=stats,
            format_version=version,
            library=library,
            content_hash=content_hash,
            part=part.rank if part is not None else None,
        )
        self.check_manifest(manifest)
        return manifest

    def shard(self, i: int, raw: Any, world_size: int, step: int, chunk_bytes: int) -> ShardInfo:
        s = self.fields(raw, self.shard_fields, _SHARD_FIELDS, f"shards[{i}]")
        file = s["file"]
        if not isinstance(file, str) or not is_safe_file(file):
            raise self.fail(f"shards[{i}].file {file!r} is not a safe relative name")
        rank = self.int_field(s["rank"], f"shards[{i}].rank", hi=world_size - 1)
        size = self.int_field(s["size"], f"shards[{i}].size")
        content: tuple[tuple[int, str], ...] = ()
        if "content" in s and "content" in self.shard_fields:
            content = self.content(s["content"], size, f"shards[{i}].content")
        ref: int | None = None
        if "step" in s and "step" in self.shard_fields:
            ref = self.int_field(s["step"], f"shards[{i}].step", hi=step - 1) if step else -1
            if ref < 0:
                raise self.fail(f"shards[{i}].step must name an earlier step than {step}")
            if not content:
                raise self.fail(f"shards[{i}] is a reference to step {ref} without content hashes")
        encoding = None
        if "encoding" in s and "encoding" in self.shard_fields:
            encoding = parse_encoding(s["encoding"], size, chunk_bytes, f"shards[{i}].encoding", self.fail)
        return ShardInfo(file, rank, size, content, ref, encoding)

    def content(self, raw: Any, size: int, what: str) -> tuple[tuple[int, str], ...]:
        if not isinstance(raw, list):
            raise self.fail(f"{what} must be an array of [bytes, hash] pairs")
        pieces = []
        for piece in raw:
            ok = isinstance(piece, list) and len(piece) == 2 and isinstance(piece[1], str)
            if not ok or not SHA256_HEX.match(piece[1]):
                raise self.fail(f"{what} must be an array of [bytes, 64-hex-digit hash] pairs")
            n = self.int_field(piece[0], f"{what} piece length", lo=ALIGN)
            if n % ALIGN:
                raise self.fail(f"{what} piece length {n} is not a multiple of {ALIGN}")
            pieces.append((n, piece[1]))
        if sum(n for n, _ in pieces) != size:
            raise self.fail(f"{what} covers {sum(n for n, _ in pieces)} bytes, the shard has {size}")
        return tuple(pieces)

    def tensors(self, raw: Any, nshards: int, chunk_bytes: int) -> dict[str, TensorEntry]:
        # Field by field first (per-value work in C); any entry that is not well formed sends the whole table
        # through the entry-by-entry checks, which raise on the first faulty entry with its name. Its depth
        # (left out by Manifest.parse's loads_strict): a table the column checks accept is 3 levels deep
        # (entry, list, scalar); any other is checked here, before it is walked.
        columns = self.tensors_columns(raw, nshards, chunk_bytes) if type(raw) is dict else None
        if columns is not None:
            self.columns = columns
            return dict(zip(columns[0], entries_from_columns(columns), strict=True))
        check_depth(raw, what=self.path, start=2)
        if not isinstance(raw, dict):
            raise self.fail("tensors must be an object")
        return {name: self.tensor(name, entry, nshards, chunk_bytes) for name, entry in raw.items()}

    def tensors_columns(self, raw: dict[str, Any], nshards: int, chunk_bytes: int) -> Columns | None:
        return tensor_columns(
            raw, nshards, chunk_bytes, fields=_TENSOR_FIELDS, max_ndim=_MAX_NDIM, max_name=_MAX_NAME,
            max_int=_MAX_INT,
        )  # fmt: skip

    def tensor(self, name: str, raw: Any, nshards: int, chunk_bytes: int) -> TensorEntry:
        if not name or len(name) > _MAX_NAME or "\x00" in name:
            raise self.fail(f"tensor name {name[:80]!r} is empty, too long or contains NUL")
        what = f"tensor {name!r}"
        t = self.fields(raw, _TENSOR_FIELDS, _TENSOR_FIELDS, what)
        dtype = t["dtype"]
        info = lookup(dtype) if isinstance(dtype, str) else None
        if info is None:
            raise self.fail(f"{what} has unknown dtype {dtype!r}")
        shape = t["shape"]
        if not isinstance(shape, list) or len(shape) > _MAX_NDIM:
            raise self.fail(f"{what} shape must be an array of at most {_MAX_NDIM} dimensions")
        dims = tuple(self.int_field(d, f"{what} shape[{i}]") for i, d in enumerate(shape))
        shard = self.int_field(t["shard"], f"{what} shard", hi=max(nshards - 1, 0))
        if nshards == 0:
            raise self.fail(f"{what} refers to shard {shard} but there are no shards")
        offset = self.int_field(t["offset"], f"{what} offset")
        nbytes = self.int_field(t["nbytes"], f"{what} nbytes")
        expected = math.prod(dims) * info.itemsize  # exact integers: no overflow possible
        if expected != nbytes:
            raise self.fail(f"{what} nbytes {nbytes} != {expected} implied by shape {list(dims)} and {dtype}")
        crcs = t["crc32c"]
        if not isinstance(crcs, list) or not all(isinstance(c, str) and _HEX8.match(c) for c in crcs):
            raise self.fail(f"{what} crc32c must be an array of 8-hex-digit strings")
        if len(crcs) != chunk_count(nbytes, chunk_bytes):
            raise self.fail(f"{what} has {len(crcs)} checksums for {chunk_count(nbytes, chunk_bytes)} chunks")
        return TensorEntry(name, dtype, dims, shard, offset, nbytes, tuple(crcs))

    def check_manifest(self, m: Manifest) -> None:
        files = [(s.step, s.file) for s in m.shards]
        if len(set(files)) != len(files):
            raise self.fail("two shards name the same file")
        for i, s in enumerate(m.shards):
            if s.size % ALIGN:
                raise self.fail(f"shards[{i}] size {s.size} is not a multiple of {ALIGN}")
        if self.columns is not None:  # the table this checker just built (build), in the same order
            shards, offsets, nbytes = self.columns[3:6]
        else:
            entries = self.entries if self.entries is not None else list(m.tensors.values())
            shards, offsets, nbytes = (
                list(map(operator.attrgetter(f), entries)) for f in ("shard", "offset", "nbytes")
            )
        if not ranges_ok([s.size for s in m.shards], shards, offsets, nbytes, ALIGN):
            every = entries_from_columns(self.columns) if self.columns is not None else entries
            raise self.fail(first_range_fault(every, [(s.file, s.size) for s in m.shards], ALIGN))
        if not self.tree_checked:
            self.check_tree(m.tree, set(m.tensors))

    def check_tree(self, tree: Any, names: set[str], referenced: list[str] | None = None) -> None:
        try:
            validate_tree(tree, names, referenced or (), self.tree_depth)
        except FormatError as exc:
            raise self.fail(str(exc)) from None
        self.tree_checked = True
