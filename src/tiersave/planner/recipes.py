"""How many bytes per parameter a checkpoint stores: precision recipes and their components.

Scope: the saved components of the training state (weights, gradients, fp32 master weights, optimizer
moments), each with its dtype, bytes per parameter and the ZeRO stage from which it is sharded across
data-parallel ranks (:class:`StateComponent`); named recipes such as ``bf16-adam-mixed`` (:data:`RECIPES`)
and custom specs such as ``"weights=bf16,master=fp32,moments=fp32+fp32"`` (:func:`get_recipe`).

Anti-scope: the parameter count (:mod:`tiersave.planner.architecture`), the layout and per-rank sizes
(:mod:`tiersave.planner.sizing`), non-tensor state (RNG, data position: kilobytes), torch dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["DTYPE_BYTES", "RECIPES", "Recipe", "StateComponent", "get_recipe"]

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
