"""Replicated state written once: the top-level keys every data-parallel rank holds identically.

In a plain DDP job every rank holds the same weights and optimizer state; written by every rank, a
checkpoint of N ranks stores them N times. ``save(step, state, replicated=["model", "optim"])`` declares
top-level keys of the state as identical on every rank. Their tensors are then written once in total: each
is assigned to one rank (whole tensors, largest first to the least loaded rank, so each of the N ranks writes
about 1/N of the bytes) and every rank's tree refers to the one copy. The global manifest names them
``replicated/<name>``; the shard holding one records its rank, and every rank reads them on restore.

tiersave cannot see that a plain tensor is replicated, so the declaration is checked rather than trusted:
at the first save with a given set of keys the ranks exchange, per key, a digest of every tensor's name,
dtype, shape, the sum of its elements' bits and a CRC-32C of bytes sampled across it (:func:`fingerprints`);
a key whose digest differs fails the save on every rank with a :class:`ConfigError` naming the key and the
ranks, before anything is written. A ``save_async`` does not wait for that exchange: each rank fingerprints its
state before returning and votes with the fingerprints, and rank 0 compares them (:func:`check_agreement`)
before committing, so a disagreement fails that save on every rank through its handle, nothing committed.
At every save each rank also votes with a digest of its replicated tensors' layout, and rank 0 refuses to
commit when they differ (collective.py).

Scope: selecting the replicated tensors of a flattened state, assigning them to ranks, fingerprinting them
and checking the fingerprints agree. Anti-scope: the manifest's layout of a collective checkpoint
(collective.py), writing (engine/), the coordination protocol (dist/).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import ConfigError, TiersaveError
from .format.checksum import crc32c_update
from .format.tree import T_NDARRAY, T_TENSOR, escape_key
from .state import FlatState, FlatTensor, as_bits, flatten

if TYPE_CHECKING:  # pragma: no cover
    from .dist import CoordinationGroup

__all__ = [
    "REPLICATED_PREFIX",
    "Selection",
    "assign",
    "check_agreement",
    "check_declaration",
    "fingerprints",
    "normalize_keys",
    "select",
]

REPLICATED_PREFIX = "replicated/"
"""The prefix of a replicated tensor's name in the global manifest (a rank's own tensors use ``rank-RRRRR/``)."""

SAMPLE_BYTES = 4096
"""How many bytes of each tensor the fingerprint reads: a strided sample across the whole tensor, so that
ranks that diverged anywhere (a different seed, a missed all-reduce) are caught without reading it all."""


def normalize_keys(replicated: Iterable[str] | None) -> tuple[str, ...]:
    """The declared keys, sorted and without duplicates.

    Raises:
        ConfigError: ``replicated`` is a single string or holds something that is not a string.
    """
    if replicated is None:
        return ()
    if isinstance(replicated, str):
        raise ConfigError(f"replicated must be a list of top-level keys, got the string {replicated!r}")
    keys = list(replicated)
    for key in keys:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"replicated keys must be non-empty strings, got {key!r}")
    return tuple(sorted(set(keys)))


@dataclass(frozen=True)
class Selection:
    """The replicated part of a flattened state.

    Attributes:
        keys: the declared top-level keys (sorted).
        tensors: the replicated tensors, in the flattened state's order.
        digest: a digest of their names, dtypes and shapes: equal on every rank when the layouts agree.
    """

    keys: tuple[str, ...]
    tensors: tuple[FlatTensor, ...]
    digest: str
    key_of: Mapping[str, str]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors)


def check_keys(state: Any, flat: FlatState, keys: Sequence[str]) -> None:
    """What :func:`select` checks of the state itself, also at a save that reuses the previous selection
    (plain values are read afresh at every save: a declared key may have gone, the tree may have changed form).

    Raises:
        ConfigError: the state is not a dict with string keys, a key is missing, or the tree is not a plain dict.
    """
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise ConfigError("replicated= names top-level keys: the state must be a dict with string keys")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ConfigError(f"replicated key(s) {missing} are not in the state (its keys: {sorted(state)[:20]})")
    if not isinstance(flat.tree, dict):  # a dict with torch's _metadata is wrapped in a tag
        raise ConfigError("replicated= needs a plain dict state (not a state_dict with _metadata)")


def select(state: Any, flat: FlatState, keys: Sequence[str]) -> Selection:
    """The tensors of ``flat`` (the flattened ``state``) under the top-level ``keys``.

    Raises:
        ConfigError: the state is not a dict with string keys, a key is missing, or a tensor is shared
            between a replicated key and a key that is not (it cannot be both written once and per rank).
    """
    check_keys(state, flat, keys)
    tree = flat.tree
    escaped = {escape_key(k): k for k in keys}
    key_of: dict[str, str] = {}
    own: set[str] = set()
    for key, node in tree.items():
        if key in escaped:
            key_of.update(dict.fromkeys(tree_refs(node), escaped[key]))
        else:
            own.update(tree_refs(node))
    both = own.intersection(key_of)
    if both:
        raise ConfigError(
            f"tensor {sorted(both)[0]!r} is referenced both under a replicated key {list(keys)} and under another "
            "key: a tensor is either identical on every rank or not"
        )
    tensors = tuple(t for t in flat.tensors if t.name in key_of)
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.name}\0{t.dtype}\0{list(t.shape)}\n".encode())
    return Selection(tuple(keys), tensors, h.hexdigest()[:32], key_of)


def tree_refs(node: Any) -> set[str]:
    """The names of the tensors and arrays an encoded tree refers to (iterative: no recursion limit)."""
    refs: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if len(item) == 1:
                ((tag, payload),) = item.items()
                if tag in (T_TENSOR, T_NDARRAY) and isinstance(payload, str):
                    refs.add(payload)
                    continue
            stack.extend(item.values())
    return refs


def assign(tensors: Sequence[FlatTensor], world_size: int) -> dict[str, int]:
    """The rank that writes each replicated tensor: largest first, each to the rank with the fewest bytes so
    far (ties: the lowest rank). Deterministic from the names and sizes, so every rank computes the same map
    with no exchange, and no rank writes more than 1/N of the bytes plus one tensor."""
    load = [(0, r) for r in range(world_size)]
    owner: dict[str, int] = {}
    for t in sorted(tensors, key=lambda t: (-t.nbytes, t.name)):
        written, rank = heapq.heappop(load)
        owner[t.name] = rank
        heapq.heappush(load, (written + t.nbytes, rank))
    return owner


def fingerprints(selection: Selection) -> dict[str, str]:
    """Per declared key, a digest of its tensors' names, dtypes, shapes and sampled bytes."""
    per_key = {k: hashlib.sha256(k.encode()) for k in selection.keys}
    for t in selection.tensors:
        per_key[selection.key_of[t.name]].update(
            f"{t.name}\0{t.dtype}\0{list(t.shape)}\0{_tensor_print(t.source)}\n".encode()
        )
    return {k: h.hexdigest()[:32] for k, h in per_key.items()}


def check_declaration(group: CoordinationGroup, state: Any, keys: tuple[str, ...], step: int) -> None:
    """Collective: every rank fingerprints its replicated state and every rank raises the same error when the
    fingerprints differ. A rank whose state does not fit the declaration (a key missing) raises its own error
    and the others a ConfigError naming it, at once, rather than at their timeout.

    Raises:
        ConfigError: on every rank, naming each key whose fingerprint differs and the ranks that differ from
            rank 0 (or lack the key), or the rank whose state does not fit the declaration.
        UnsupportedStateError: this rank's state cannot be flattened.
        DistributedCheckpointError: a rank failed or did not answer in time.
    """
    error: TiersaveError | None = None
    try:
        prints: Any = fingerprints(select(state, flatten(state), keys))
    except TiersaveError as exc:  # tell the others, then raise it here
        error, prints = exc, {"$error": f"{type(exc).__name__}: {exc}"}
    docs = group.all_gather_json(prints, step=step)
    if error is not None:
        raise error
    broken = {r: d["$error"] for r, d in enumerate(docs) if isinstance(d, dict) and "$error" in d}
    if broken:
        raise ConfigError(
            f"step {step}: the state of rank(s) {sorted(broken)} does not fit replicated={list(keys)}: "
            + "; ".join(f"rank {r}: {m}" for r, m in sorted(broken.items()))
        )
    check_agreement(docs, step)


def check_agreement(docs: Sequence[Any], step: int) -> None:
    """Every rank's fingerprints (by rank) must equal rank 0's.

    Raises:
        ConfigError: naming each key whose fingerprint differs and the ranks that differ from rank 0 (or lack
            the key).
    """
    reference = docs[0] if isinstance(docs[0], dict) else {}
    problems = []
    for key in sorted({k for d in docs if isinstance(d, dict) for k in d} | set(reference)):
        differ = [r for r, d in enumerate(docs) if not isinstance(d, dict) or d.get(key) != reference.get(key)]
        if differ:
            problems.append(f"{key!r} differs on rank(s) {differ} from rank 0")
    if problems:
        raise ConfigError(
            f"step {step}: state declared replicated is not identical on every rank: "
            + "; ".join(problems)
            + " (compared: every tensor's name, dtype, shape and a sample of its bytes). Declare only state that "
            "every rank holds identically (DDP weights and optimizer state), or save it per rank"
        )


def _tensor_print(source: torch.Tensor | np.ndarray) -> str:
    """A tensor's fingerprint: the wrapping 64-bit sum of all its elements' bit patterns (one pass over its
    memory, on its device: catches a single changed element) and a CRC-32C of at most :data:`SAMPLE_BYTES`
    bytes taken at an even stride (catches most reorderings, which a sum misses)."""
    t = torch.from_numpy(np.ascontiguousarray(source)) if isinstance(source, np.ndarray) else source.detach()
    if t.numel() == 0:
        return "0:0"
    bits = as_bits(t).reshape(-1)  # a view when contiguous; a copy otherwise (first save only)
    if bits.is_floating_point() or bits.is_complex():  # 16-byte elements have no same-width integer type
        bits = bits.contiguous().view(torch.int64)
    if bits.dtype == torch.bool:
        bits = bits.view(torch.uint8)
    total = int(bits.sum(dtype=torch.int64))
    stride = max(1, bits.numel() * bits.element_size() // SAMPLE_BYTES)
    sample = bits[::stride][: max(1, SAMPLE_BYTES // bits.element_size())].contiguous().cpu()
    return f"{total & 0xFFFFFFFFFFFFFFFF:x}:{crc32c_update(0, sample.view(torch.uint8).numpy().tobytes()):08x}"
