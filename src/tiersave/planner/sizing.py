"""Checkpoint size from a model description, a precision recipe and a parallel layout.

Scope: the number of bytes a checkpoint holds, in total and per rank, computed from a parameter count or an
architecture preset (``llama3-70b``...) and a :class:`Recipe` that states the bytes per parameter of every
saved component (weights, gradients, fp32 master weights, each optimizer moment); per-rank sizes under
tensor, pipeline and data parallelism with ZeRO-style sharding (FSDP is ZeRO-3); and the size of a real state
dict or of a model built on the ``meta`` device (:func:`measure_state`). Every result carries the
assumptions that produced it, so a printed figure can be checked by hand.

Anti-scope: activations, temporary buffers and allocator overheads (they are never checkpointed); non-tensor
state such as RNG, data position and scheduler (kilobytes); the failure model and bandwidth needs, which
live in :mod:`tiersave.schedule`.

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

__all__ = [
    "DTYPE_BYTES",
    "PRESETS",
    "RECIPES",
    "Architecture",
    "CheckpointSize",
    "ComponentSize",
    "MeasuredState",
    "Parallelism",
    "Recipe",
    "StateComponent",
    "checkpoint_size",
    "get_preset",
    "get_recipe",
    "measure_state",
]

DTYPE_BYTES: Mapping[str, float] = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,  # stored as fp32
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}

# A component is sharded across data-parallel ranks from this ZeRO stage on (DeepSpeed's definition:
# stage 1 shards the optimizer state, 2 adds gradients, 3 adds the parameters; FSDP FULL_SHARD is stage 3).
_SHARDED_FROM = {"weights": 3, "grads": 2, "master": 1, "moment": 1}


def _num(value: float) -> str:
    return f"{value:g}"


def _require_positive_int(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------------------------- architecture


@dataclass(frozen=True, kw_only=True, slots=True)
class Architecture:
    """A decoder-only transformer, described well enough to count its parameters exactly.

    Attributes:
        name: preset name, e.g. ``"llama3-70b"``.
        layers: transformer blocks.
        hidden: model width (d_model).
        ffn_hidden: MLP inner width.
        heads: attention (query) heads; the head size is ``hidden // heads``.
        kv_heads: key/value heads (grouped-query attention); equal to ``heads`` for multi-head attention.
        vocab: vocabulary size (embedding rows).
        gated_mlp: SwiGLU-style MLP with three matrices (gate, up, down) instead of two.
        tied_embeddings: the output head reuses the input embedding matrix.
        bias: linear layers carry biases (GPT-2/GPT-3 style).
        layernorm: LayerNorm with weight and bias; ``False`` means RMSNorm (weight only).
        max_positions: rows of a learned absolute position embedding; 0 for rotary embeddings.
        source: where the numbers come from.
    """

    name: str
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    gated_mlp: bool = True
    tied_embeddings: bool = False
    bias: bool = False
    layernorm: bool = False
    max_positions: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        for attr in ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab"):
            _require_positive_int(f"{self.name}: {attr}", getattr(self, attr))
        if self.max_positions < 0:
            raise ConfigError(f"{self.name}: max_positions must be >= 0, got {self.max_positions}")
        if self.hidden % self.heads:
            raise ConfigError(f"{self.name}: hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"{self.name}: heads={self.heads} is not divisible by kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden // self.heads

    @property
    def norm_params(self) -> int:
        """Parameters of one normalization layer."""
        return 2 * self.hidden if self.layernorm else self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block (attention, MLP, two norms)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h  # q, k, v, o
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn_hidden
        if self.bias:
            attn += h + 2 * kv + h
            mlp += (2 if self.gated_mlp else 1) * self.ffn_hidden + h
        return attn + mlp + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Input token embedding plus learned position embedding (first pipeline stage)."""
        return (self.vocab + self.max_positions) * self.hidden

    @property
    def head_params(self) -> int:
        """Final norm plus output projection (last pipeline stage); the projection is free when tied."""
        return self.norm_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def param_count(self) -> int:
        """Total parameters, counting a tied embedding once."""
        return self.embedding_params + self.layers * self.layer_params + self.head_params

    def stage_params(self, pp: int) -> tuple[int, ...]:
        """Parameters held by each of ``pp`` pipeline stages.

        The first stage holds the embeddings and the last the output head, so when the layers do not
        divide evenly the extra layers go to the middle stages first (Llama 3 405B trained with fewer
        layers on its first and last stages for this reason). With a tied head the last stage keeps its
        own copy of the embedding, as Megatron-LM does, so the stage sizes can sum to more than
        :attr:`param_count`.

        Raises:
            ConfigError: ``pp`` is not positive or exceeds the number of layers.
        """
        _require_positive_int("pp", pp)
        if pp > self.layers:
            raise ConfigError(f"pp={pp} exceeds the {self.layers} layers of {self.name}")
        if pp == 1:
            return (self.param_count,)
        base, extra = divmod(self.layers, pp)
        order = [*range(1, pp - 1), 0, pp - 1]  # who receives an extra layer, middle stages first
        layers = [base] * pp
        for stage in order[:extra]:
            layers[stage] += 1
        params = [n * self.layer_params for n in layers]
        params[0] += self.embedding_params
        params[-1] += self.head_params + (self.vocab * self.hidden if self.tied_embeddings else 0)
        return tuple(params)

    def describe(self) -> str:
        """One line stating the architecture, for reports."""
        parts = [
            f"{self.layers} layers",
            f"hidden {self.hidden}",
            f"ffn {self.ffn_hidden}{' (gated)' if self.gated_mlp else ''}",
            f"{self.heads} heads ({self.kv_heads} kv)",
            f"vocab {self.vocab}",
        ]
        if self.max_positions:
            parts.append(f"{self.max_positions} learned positions")
        if self.tied_embeddings:
            parts.append("tied embeddings")
        if self.bias:
            parts.append("biases")
        parts.append("LayerNorm" if self.layernorm else "RMSNorm")
        return f"{self.name}: " + ", ".join(parts)


def _llama(name: str, layers: int, hidden: int, ffn: int, heads: int, *, tied: bool = False) -> Architecture:
    return Architecture(
        name=name,
        layers=layers,
        hidden=hidden,
        ffn_hidden=ffn,
        heads=heads,
        kv_heads=8,
        vocab=128_256,
        tied_embeddings=tied,
        source="Meta Llama 3 model cards / config.json (GQA with 8 kv heads, SwiGLU, RMSNorm, RoPE)",
    )


def _gpt(name: str, layers: int, hidden: int, heads: int, positions: int, source: str) -> Architecture:
    return Architecture(
        name=name,
        layers=layers,
        hidden=hidden,
        ffn_hidden=4 * hidden,
        heads=heads,
        kv_heads=heads,
        vocab=50_257,
        gated_mlp=False,
        tied_embeddings=True,
        bias=True,
        layernorm=True,
        max_positions=positions,
        source=source,
    )


PRESETS: Mapping[str, Architecture] = {
    a.name: a
    for a in (
        _llama("llama3.2-1b", 16, 2048, 8192, 32, tied=True),
        _llama("llama3-8b", 32, 4096, 14_336, 32),
        _llama("llama3-70b", 80, 8192, 28_672, 64),
        _llama("llama3-405b", 126, 16_384, 53_248, 128),
        _gpt("gpt2", 12, 768, 12, 1024, "GPT-2 small, Radford et al. 2019 / HF config"),
        _gpt("gpt2-xl", 48, 1600, 25, 1024, "GPT-2 XL, Radford et al. 2019 / HF config"),
        _gpt("gpt3-175b", 96, 12_288, 96, 2048, "GPT-3 175B, Brown et al. 2020, table 2.1"),
    )
}


def get_preset(name: str) -> Architecture:
    """Return the architecture preset called ``name`` (case-insensitive).

    Raises:
        ConfigError: unknown name; the message lists the known presets.
    """
    preset = PRESETS.get(name.strip().lower())
    if preset is None:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return preset


# ------------------------------------------------------------------------------------------------- recipes


@dataclass(frozen=True, kw_only=True, slots=True)
class StateComponent:
    """One saved part of the training state, sized per parameter.

    Attributes:
        name: ``"weights"``, ``"grads"``, ``"master"``, or an optimizer moment (``"exp_avg"``...).
        role: ``"weights"``, ``"grads"``, ``"master"`` or ``"moment"``; decides the ZeRO stage that shards it.
        dtype: storage type, e.g. ``"bf16"``, or ``""`` when only the byte count is known.
        bytes_per_param: bytes stored per model parameter.
    """

    name: str
    role: str
    dtype: str
    bytes_per_param: float

    def __post_init__(self) -> None:
        if self.role not in _SHARDED_FROM:
            raise ConfigError(f"component {self.name!r}: role must be one of {', '.join(_SHARDED_FROM)}")
        if not (math.isfinite(self.bytes_per_param) and self.bytes_per_param > 0):
            raise ConfigError(f"component {self.name!r}: bytes per parameter must be > 0, got {self.bytes_per_param}")

    @property
    def sharded_from_zero_stage(self) -> int:
        """The lowest ZeRO stage that shards this component across data-parallel ranks."""
        return _SHARDED_FROM[self.role]

    @property
    def label(self) -> str:
        """``"weights (bf16)"``-style label for reports."""
        return f"{self.name} ({self.dtype})" if self.dtype else self.name


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """What a checkpoint stores per parameter: a named list of :class:`StateComponent`.

    Attributes:
        name: recipe name, e.g. ``"bf16-adam-mixed"``.
        components: the saved components, in report order.
        description: one line saying when the recipe applies.
    """

    name: str
    components: tuple[StateComponent, ...]
    description: str = ""

    def __post_init__(self) -> None:
        if not self.components:
            raise ConfigError(f"recipe {self.name!r} has no components")
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ConfigError(f"recipe {self.name!r} names a component twice: {', '.join(names)}")

    @property
    def bytes_per_param(self) -> float:
        """Sum of the components' bytes per parameter."""
        return sum(c.bytes_per_param for c in self.components)

    def describe(self) -> str:
        """``"bf16-adam-mixed: weights (bf16) 2 + master (fp32) 4 + ... = 14 bytes/param"``."""
        terms = " + ".join(f"{c.label} {_num(c.bytes_per_param)}" for c in self.components)
        return f"{self.name}: {terms} = {_num(self.bytes_per_param)} bytes/param"


def _component(name: str, role: str, dtype: str) -> StateComponent:
    return StateComponent(name=name, role=role, dtype=dtype, bytes_per_param=DTYPE_BYTES[dtype])


_ADAM = (_component("exp_avg", "moment", "fp32"), _component("exp_avg_sq", "moment", "fp32"))

RECIPES: Mapping[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="bf16-weights-only",
            components=(_component("weights", "weights", "bf16"),),
            description="weights only in bf16: an inference or export checkpoint",
        ),
        Recipe(
            name="fp32-weights-only",
            components=(_component("weights", "weights", "fp32"),),
            description="weights only in fp32",
        ),
        Recipe(
            name="fp32-adam",
            components=(_component("weights", "weights", "fp32"), *_ADAM),
            description="fp32 training with Adam: fp32 weights and two fp32 moments",
        ),
        Recipe(
            name="bf16-adam-master",
            components=(_component("master", "master", "fp32"), *_ADAM),
            description=(
                "bf16 mixed precision with Adam, saving the fp32 master weights and moments only "
                "(the bf16 working copy is rebuilt from the master on restore)"
            ),
        ),
        Recipe(
            name="bf16-adam-mixed",
            components=(
                _component("weights", "weights", "bf16"),
                _component("master", "master", "fp32"),
                *_ADAM,
            ),
            description="bf16 mixed precision with Adam: bf16 weights, fp32 master weights, two fp32 moments",
        ),
        Recipe(
            name="bf16-adam-mixed-grads",
            components=(
                _component("weights", "weights", "bf16"),
                _component("grads", "grads", "bf16"),
                _component("master", "master", "fp32"),
                *_ADAM,
            ),
            description="bf16-adam-mixed plus bf16 gradients: the 16 bytes/param the ZeRO paper counts in memory",
        ),
    )
}

_CUSTOM_KEYS = ("weights", "grads", "master", "moments")


def get_recipe(spec: str | Recipe) -> Recipe:
    """Return a precision recipe by name, or build one from a spec.

    A spec names bytes or dtypes per component, e.g. ``"weights=bf16,master=fp32,moments=fp32+fp32"`` or
    ``"weights=2,moments=1+1"`` (two 8-bit moments). Keys are ``weights``, ``grads``, ``master`` and
    ``moments`` (``+`` separates moments); values are a dtype (``fp32``, ``bf16``, ``fp16``, ``fp8``,
    ``int8``, ``int4``) or a number of bytes.

    Raises:
        ConfigError: unknown name (the message lists the presets), or a malformed spec.
    """
    if isinstance(spec, Recipe):
        return spec
    text = spec.strip()
    preset = RECIPES.get(text.lower())
    if preset is not None:
        return preset
    if "=" not in text:
        raise ConfigError(
            f"unknown recipe {spec!r}; known recipes: {', '.join(RECIPES)}; "
            "or give a spec such as 'weights=bf16,master=fp32,moments=fp32+fp32'"
        )
    components: list[StateComponent] = []
    seen: set[str] = set()
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip().lower()
        if key not in _CUSTOM_KEYS or not value.strip():
            raise ConfigError(f"recipe spec {spec!r}: expected KEY=VALUE with KEY in {', '.join(_CUSTOM_KEYS)}")
        if key in seen:
            raise ConfigError(f"recipe spec {spec!r}: {key} given twice")
        seen.add(key)
        if key == "moments":
            for i, part in enumerate(value.split("+"), start=1):
                dtype, size = _parse_dtype_or_bytes(part, spec)
                components.append(StateComponent(name=f"moment{i}", role="moment", dtype=dtype, bytes_per_param=size))
        else:
            dtype, size = _parse_dtype_or_bytes(value, spec)
            components.append(StateComponent(name=key, role=key, dtype=dtype, bytes_per_param=size))
    return Recipe(name="custom", components=tuple(components), description=f"custom recipe {text}")


def _parse_dtype_or_bytes(value: str, spec: str) -> tuple[str, float]:
    token = value.strip().lower()
    if token in DTYPE_BYTES:
        return token, DTYPE_BYTES[token]
    try:
        size = float(token)
    except ValueError:
        raise ConfigError(
            f"recipe spec {spec!r}: {value.strip()!r} is neither a dtype ({', '.join(DTYPE_BYTES)}) "
            "nor a number of bytes"
        ) from None
    if not (math.isfinite(size) and size > 0):
        raise ConfigError(f"recipe spec {spec!r}: bytes per parameter must be > 0, got {value.strip()}")
    return "", size


# ------------------------------------------------------------------------------------------------- layout


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
            _require_positive_int(attr, getattr(self, attr))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3 (FSDP = 3), got {self.zero_stage!r}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, zero_stage: int = 0) -> Parallelism:
        """The layout with ``dp = world_size / (tp * pp)``.

        Raises:
            ConfigError: ``tp * pp`` does not divide ``world_size``.
        """
        _require_positive_int("tp", tp)
        _require_positive_int("pp", pp)
        _require_positive_int("world_size", world_size)
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
        _require_positive_int("parameter count", model)  # also rejects bool and float
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


# -------------------------------------------------------------------------------------------- quantities
