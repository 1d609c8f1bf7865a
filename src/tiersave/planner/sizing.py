"""How many bytes a checkpoint holds, in total and per rank: computed from a description, or measured.

Scope: the bytes of one checkpoint from a parameter count or an architecture
(:mod:`tiersave.planner.architecture`) and a precision recipe (:mod:`tiersave.planner.recipes`); per-rank
sizes under tensor, pipeline and data parallelism with ZeRO-style sharding (FSDP is ZeRO-3)
(:class:`Parallelism`, :func:`checkpoint_size`); and the size of a real state dict or of a model built on
the ``meta`` device (:func:`measure_state`). Every computed result carries the assumptions that produced it,
so a printed figure can be checked by hand.

Anti-scope: activations, temporary buffers and allocator overheads (they are never checkpointed); non-tensor
state such as RNG, data position and scheduler (kilobytes); the failure model and bandwidth needs, which
live in :mod:`tiersave.planner.failures` and :mod:`tiersave.planner.bandwidth`.

This module imports only the standard library. :func:`measure_state` reads tensors through their own
methods, so it works on torch tensors without importing torch here.

Example::

    >>> size = checkpoint_size("llama3-70b", "bf16-weights-only")
    >>> round(size.total_bytes / 2**30)
    131
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ._checks import require_count
from .architecture import Architecture, get_preset
from .recipes import Recipe, StateComponent, get_recipe

__all__ = ["CheckpointSize", "ComponentSize", "MeasuredState", "Parallelism", "checkpoint_size", "measure_state"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallelism:
    """How the ranks split the model: tensor x pipeline x data parallel, plus ZeRO sharding.

    Attributes:
        tp: tensor-parallel degree (every weight matrix split ``tp`` ways).
        pp: pipeline-parallel degree (layers split into ``pp`` stages).
        dp: data-parallel degree (replicas, or shards under ZeRO).
        zero_stage: 0 replicates everything across ``dp``; 1 shards the optimizer state (master weights and
            moments); 2 also the gradients; 3 (FSDP FULL_SHARD) also the weights.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0

    def __post_init__(self) -> None:
        for attr in ("tp", "pp", "dp"):
            require_count(attr, getattr(self, attr))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3 (FSDP = 3), got {self.zero_stage!r}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, zero_stage: int = 0) -> Parallelism:
        """The layout with ``dp = world_size / (tp * pp)``.

        Raises:
            ConfigError: ``tp * pp`` does not divide ``world_size``.
        """
        require_count("tp", tp)
        require_count("pp", pp)
        require_count("world_size", world_size)
        if world_size % (tp * pp):
            raise ConfigError(
                f"tp={tp} x pp={pp} = {tp * pp} does not divide the {world_size} ranks "
                "(world size must be tp x pp x dp)"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), zero_stage=zero_stage)

    @property
    def world_size(self) -> int:
        """Total ranks, ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @property
    def zero_label(self) -> str:
        """``"ZeRO-1"``, ``"ZeRO-3 (FSDP)"`` or ``"no ZeRO sharding"``."""
        if self.zero_stage == 0:
            return "no ZeRO sharding"
        return f"ZeRO-{self.zero_stage}" + (" (FSDP)" if self.zero_stage == 3 else "")

    def describe(self) -> str:
        """``"tp=8 pp=16 dp=8 (1024 ranks), ZeRO-1"``."""
        ranks = f"{self.world_size} rank{'' if self.world_size == 1 else 's'}"
        return f"tp={self.tp} pp={self.pp} dp={self.dp} ({ranks}), {self.zero_label}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ComponentSize:
    """Bytes of one component in the whole checkpoint and on the most loaded rank.

    Attributes:
        component: what is sized.
        total_bytes: bytes in the checkpoint, counted once (replicas deduplicated).
        rank_held_bytes: bytes the most loaded rank holds in memory.
        sharded_over_dp: whether the layout shards this component across data-parallel ranks.
    """

    component: StateComponent
    total_bytes: int
    rank_held_bytes: int
    sharded_over_dp: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSize:
    """The size of a checkpoint, in total and per rank, with the assumptions behind it.

    Attributes:
        params: parameter count.
        model: the architecture, when sized from one.
        recipe: the precision recipe.
        parallelism: the layout used for the per-rank figures.
        components: one entry per recipe component.
        total_bytes: bytes in one checkpoint of the whole job (tensor data only).
        rank_held_bytes: bytes the most loaded rank holds of that state.
        rank_written_bytes: bytes the most loaded rank writes when data-parallel replicas split the writing
            of replicated tensors (tiersave's default), i.e. its model-parallel shard divided by ``dp``.
        assumptions: every assumption behind the figures, as sentences.
    """

    params: int
    model: Architecture | None
    recipe: Recipe
    parallelism: Parallelism
    components: tuple[ComponentSize, ...]
    total_bytes: int
    rank_held_bytes: int
    rank_written_bytes: int
    assumptions: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.params <= 0 or self.total_bytes <= 0:
            raise ConfigError("a checkpoint size needs a positive parameter count and byte total")


def checkpoint_size(
    model: str | int | Architecture,
    recipe: str | Recipe,
    parallelism: Parallelism | None = None,
) -> CheckpointSize:
    """Size one checkpoint of ``model`` saved with ``recipe`` under ``parallelism``.

    Args:
        model: a preset name (``"llama3-70b"``), an :class:`Architecture`, or a parameter count.
        recipe: a recipe name, spec (see :func:`get_recipe`) or :class:`Recipe`.
        parallelism: the layout for per-rank figures; a single rank when omitted.

    Returns:
        The total and per-rank sizes with the assumptions that produced them.

    Raises:
        ConfigError: unknown preset or recipe, a non-positive parameter count, or a layout that does not
            fit the model (``tp`` not dividing the heads, ``pp`` above the layer count).

    Example::

        >>> s = checkpoint_size("llama3-405b", "bf16-adam-master")
        >>> round(s.total_bytes / 1e12, 2)
        4.87
    """
    layout = parallelism or Parallelism()
    rec = get_recipe(recipe)
    arch: Architecture | None
    if isinstance(model, (str, Architecture)):
        arch = get_preset(model) if isinstance(model, str) else model
        params = arch.param_count
    else:
        require_count("parameter count", model)  # also rejects bool and float
        arch, params = None, model

    assumptions = [
        f"recipe {rec.describe()}",
        "tensor data only: RNG, data position and scheduler state add kilobytes",
    ]
    if arch is not None:
        assumptions.insert(0, f"model {arch.describe()} -> {params:,} parameters")
        if arch.heads % layout.tp:
            raise ConfigError(f"tp={layout.tp} does not divide the {arch.heads} attention heads of {arch.name}")
        stages = arch.stage_params(layout.pp)
        heaviest = max(stages)
        if layout.pp > 1:
            assumptions.append(
                f"pipeline stages hold {min(stages):,} to {heaviest:,} parameters "
                "(embeddings on the first stage, output head on the last, extra layers in the middle)"
            )
    else:
        assumptions.insert(0, f"{params:,} parameters (no architecture: pipeline stages assumed equal)")
        heaviest = math.ceil(params / layout.pp)
    if layout.tp > 1:
        assumptions.append(
            f"tensor parallelism splits every parameter {layout.tp} ways "
            "(norm weights, which stay replicated, are under 0.01% of the total)"
        )
    if layout.dp > 1:
        assumptions.append(
            f"{layout.dp} data-parallel ranks with {layout.zero_label}: replicated tensors are "
            "written once, their bytes split across the replicas"
        )

    sizes: list[ComponentSize] = []
    for comp in rec.components:
        sharded = layout.zero_stage >= comp.sharded_from_zero_stage
        held = heaviest * comp.bytes_per_param / layout.tp / (layout.dp if sharded else 1)
        sizes.append(
            ComponentSize(
                component=comp,
                total_bytes=round(params * comp.bytes_per_param),
                rank_held_bytes=math.ceil(held),
                sharded_over_dp=sharded,
            )
        )
    written = math.ceil(heaviest * rec.bytes_per_param / layout.tp / layout.dp)
    return CheckpointSize(
        params=params,
        model=arch,
        recipe=rec,
        parallelism=layout,
        components=tuple(sizes),
        total_bytes=sum(s.total_bytes for s in sizes),
        rank_held_bytes=sum(s.rank_held_bytes for s in sizes),
        rank_written_bytes=written,
        assumptions=tuple(assumptions),
    )


# ------------------------------------------------------------------------------------------------- measure


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredState:
    """The tensor bytes in a real state tree.

    Attributes:
        tensors: tensor (or array) leaves found.
        numel: their total element count.
        total_bytes: their total bytes, counting every leaf.
        unique_bytes: bytes with leaves that share storage (tied weights) counted once.
        bytes_by_dtype: ``total_bytes`` split by dtype name.
    """

    tensors: int
    numel: int
    total_bytes: int
    unique_bytes: int
    bytes_by_dtype: Mapping[str, int]


def measure_state(state: object) -> MeasuredState:
    """Measure the tensors in a state tree, a module or an optimizer, without reading their data.

    Tensors on the ``meta`` device work, so a model too large for this machine can be sized with
    ``with torch.device("meta"): model = Model(cfg)`` and ``measure_state(model)``. Modules and optimizers
    are measured through ``state_dict()`` (``keep_vars=True`` for modules, so that tied parameters are seen
    as one). numpy arrays are measured too. Non-tensor leaves (ints, strings) are ignored.

    Args:
        state: a tensor, a numpy array, an object with ``state_dict()``, or a dict/list/tuple of those.

    Returns:
        Counts and bytes; ``unique_bytes`` counts a storage shared by several leaves once (on ``meta``,
        where storages have no address, only the same tensor object is recognised as shared).

    Raises:
        ConfigError: the tree nests deeper than 100 levels or contains a cycle.
    """
    by_dtype: dict[str, int] = {}
    seen: set[tuple[Any, ...]] = set()
    tensors = numel = total = unique = 0
    for leaf in _tensor_leaves(state, depth=0, active=set()):
        count, nbytes, dtype, key = _describe_leaf(leaf)
        tensors += 1
        numel += count
        total += nbytes
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
        if key not in seen:
            seen.add(key)
            unique += nbytes
    return MeasuredState(tensors=tensors, numel=numel, total_bytes=total, unique_bytes=unique, bytes_by_dtype=by_dtype)


def _is_tensor(obj: object) -> bool:
    return callable(getattr(obj, "element_size", None)) and callable(getattr(obj, "numel", None))


def _is_array(obj: object) -> bool:
    return isinstance(getattr(obj, "nbytes", None), int) and hasattr(obj, "dtype") and hasattr(obj, "shape")


def _tensor_leaves(obj: object, *, depth: int, active: set[int]) -> Iterator[Any]:
    if depth > 100:
        raise ConfigError("state tree nests deeper than 100 levels")
    if _is_tensor(obj) or _is_array(obj):
        yield obj
        return
    children: Any
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and not isinstance(obj, Mapping):
        try:
            children = state_dict(keep_vars=True)
        except TypeError:  # optimizers take no keep_vars
            children = state_dict()
        children = [children]
    elif isinstance(obj, Mapping):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        return
    if id(obj) in active:
        raise ConfigError("state tree contains a cycle")
    active.add(id(obj))
    for child in children:
        yield from _tensor_leaves(child, depth=depth + 1, active=active)
    active.discard(id(obj))


def _describe_leaf(leaf: Any) -> tuple[int, int, str, tuple[Any, ...]]:
    """Element count, bytes, dtype name and a sharing key for one tensor or array."""
    if _is_tensor(leaf):
        count = int(leaf.numel())
        nbytes = count * int(leaf.element_size())
        dtype = str(leaf.dtype).removeprefix("torch.")
        address = 0
        if str(getattr(leaf, "device", "")) != "meta":
            address = int(leaf.untyped_storage().data_ptr()) + int(leaf.storage_offset()) * int(leaf.element_size())
        key: tuple[Any, ...] = ("addr", address, nbytes) if address else ("id", id(leaf))
        return count, nbytes, dtype, key
    count, nbytes = int(leaf.size), int(leaf.nbytes)
    interface = getattr(leaf, "__array_interface__", None)
    address = int(interface["data"][0]) if isinstance(interface, dict) else 0
    key = ("addr", address, nbytes) if address else ("id", id(leaf))
    return count, nbytes, str(leaf.dtype), key
