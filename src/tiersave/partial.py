"""Partial and transfer-learning restores: which part of a saved tree to read, and how leniently to load it.

Scope: pruning a decoded tree (tensors still placeholders) to the paths a restore asks for (``keys=``) and to
what the live state holds (``into=``), so that only those tensors' bytes are read; with ``strict=False``, leaving
out what the live state cannot take (keys it lacks, tensors of another shape) and reporting it; loading
``torch.nn.Module`` objects with ``strict=False``; the rules of the opt-in dtype cast (``cast=True``, ``dtype=``).
Anti-scope: reading bytes (engine/), choosing the copy and the destinations (restore.py), the tree encoding and
the plain restore (state.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import ConfigError, StateMismatchError
from .state import _ARRAYS, _path_join, _Ref, _StatefulNode, is_stateful, torch_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """What part of a checkpoint a restore reads, and whether dtypes may be converted.

    Attributes:
        keys: paths into the saved tree (``"model"``, ``"model.encoder"``, ``"optim.state"``); None: all of it.
        cast: convert floating-point tensors to the live tensor's dtype instead of failing on a dtype mismatch.
        dtype: return floating-point tensors as this dtype (implies ``cast``).
    """

    keys: tuple[str, ...] | None = None
    cast: bool = False
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, keys: str | Sequence[str] | None, cast: bool, dtype: Any) -> Selection:
        """Validate ``restore()``'s ``keys``, ``cast`` and ``dtype`` arguments."""
        paths: tuple[Any, ...] | None = None
        if keys is not None:
            paths = (keys,) if not isinstance(keys, (list, tuple)) else tuple(keys)
            if not paths or not all(isinstance(k, str) and k and not k.startswith(".") for k in paths):
                raise ConfigError(
                    f"keys must be a non-empty list of paths such as 'model' or 'model.encoder', got {keys!r}"
                )
        if not isinstance(cast, bool):
            raise ConfigError(f"cast must be True or False, got {cast!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"dtype must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")
        return cls(paths, cast, dtype)

    @property
    def casting(self) -> bool:
        return self.cast or self.dtype is not None


ALL = Selection()


@dataclass
class LoadReport:
    """What a lenient or casting restore left out or converted (paths into the state)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def log(self, step: int) -> None:
        """One log line when anything was left out or converted (a new head, a bf16 model)."""
        if not (self.missing or self.unexpected or self.mismatched or self.cast):
            return
        parts = []
        for what, paths in (("missing", self.missing), ("unexpected", self.unexpected), ("cast", self.cast)):
            if paths:
                parts.append(f"{len(paths)} {what} ({_some(paths)})")
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} shape-mismatched ({_some(self.details)})")
        log.warning("restore of step %d: %s", step, "; ".join(parts))


def _some(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


_NOTHING: Any = object()


def _like(node: dict[Any, Any]) -> dict[Any, Any]:
    """An empty dict of ``node``'s kind (a state dict keeps torch's ``_metadata``)."""
    if isinstance(node, OrderedDict):
        out: dict[Any, Any] = OrderedDict()
        if hasattr(node, "_metadata"):
            out._metadata = node._metadata  # type: ignore[attr-defined]
        return out
    return {}


def select_keys(saved: Any, keys: Sequence[str], step: int) -> Any:
    """``saved`` pruned to the subtrees named by ``keys``.

    A path walks nested dicts by key and also matches the dotted keys of a flat state dict: ``"model.encoder"``
    selects ``saved["model"]["encoder.0.weight"]``, ``saved["model"]["encoder.0.bias"]``...

    Raises:
        StateMismatchError: a path names nothing in the checkpoint.
    """
    out: Any = _NOTHING
    for key in keys:
        part = _select(saved, key)
        if part is _NOTHING:
            top = list(saved) if isinstance(saved, dict) else []
            raise StateMismatchError(
                f"step {step} has no {key!r}"
                + (f" (its top-level keys: {_some([str(k) for k in top], 10)})" if top else "")
            )
        out = part if out is _NOTHING else _merge(out, part)
    return out


def _select(node: Any, rest: str) -> Any:
    if isinstance(node, _StatefulNode):
        inner = _select(node.state, rest)
        return _NOTHING if inner is _NOTHING else _StatefulNode(node.type_name, inner)
    if not isinstance(node, dict):
        return _NOTHING  # a leaf or a list: a path cannot go inside it
    out = _like(node)
    for k, v in node.items():
        name = str(k)
        if name == rest or name.startswith(rest + "."):
            out[k] = v
        elif rest.startswith(name + "."):
            sub = _select(v, rest[len(name) + 1 :])
            if sub is not _NOTHING:
                out[k] = sub
    return out if out else _NOTHING


def _merge(a: Any, b: Any) -> Any:
    """The union of two selections of the same tree."""
    if isinstance(a, _StatefulNode) and isinstance(b, _StatefulNode):
        return _StatefulNode(a.type_name, _merge(a.state, b.state))
    if isinstance(a, dict) and isinstance(b, dict):
        out = _like(a)
        out.update(a)
        for k, v in b.items():
            out[k] = _merge(a[k], v) if k in a else v
        return out
    return a


def select_into(
    saved: Any, live: Any, *, strict: bool, shapes: Mapping[str, tuple[int, ...]], report: LoadReport
) -> Any:
    """``saved`` pruned to what ``live`` holds: keys ``live`` lacks are neither read nor added to it.

    With ``strict=False`` it also leaves out, and reports, what ``live`` cannot take: tensors of another shape
    (plain ones, and a module's), keys a module does not have; and it reports the keys of ``live`` the
    checkpoint lacks. ``shapes`` maps stored tensor names to their shapes.
    """
    return _into(saved, live, "", strict, shapes, report)


def _into(
    saved: Any, live: Any, path: str, strict: bool, shapes: Mapping[str, tuple[int, ...]], report: LoadReport
) -> Any:
    if live is None:
        return saved  # a placeholder the caller left for this subtree: read it whole
    if is_stateful(live):
        if not strict and isinstance(live, torch.nn.Module):
            return _into_module(saved, live, path, shapes, report)
        return saved  # the object takes its whole state; load_state_dict decides
    if isinstance(saved, _StatefulNode):
        inner = _into(saved.state, live, path, strict, shapes, report)
        return _NOTHING if inner is _NOTHING else _StatefulNode(saved.type_name, inner)
    if isinstance(saved, _Ref):
        if not strict and isinstance(live, (torch.Tensor, np.ndarray)) and tuple(live.shape) != shapes[saved.name]:
            _mismatch(report, path, shapes[saved.name], tuple(live.shape))
            return _NOTHING
        return saved
    if isinstance(saved, dict) and isinstance(live, dict):
        out = _like(saved)
        for k, v in saved.items():
            if k not in live:
                continue
            lv = live[k]
            if type(v) is _Ref and isinstance(lv, _ARRAYS):  # a tensor's leaf (most of a state), inline
                if strict or lv.shape == shapes[v.name]:
                    out[k] = v
                else:
                    _mismatch(report, _path_join(path, k), shapes[v.name], tuple(lv.shape))
                continue
            sub = _into(v, lv, _path_join(path, k), strict, shapes, report)
            if sub is not _NOTHING:
                out[k] = sub
        if not strict:
            report.missing.extend(_path_join(path, k) for k in live if k not in saved)
        return out
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        items = [
            _into(s, lv, _path_join(path, i), strict, shapes, report) for i, (s, lv) in enumerate(zip(saved, live))
        ]
        if any(item is _NOTHING for item in items):
            return _NOTHING  # positions matter: a list is loaded whole or not at all
        return items if isinstance(saved, list) else tuple(items)
    return saved


def _into_module(
    saved: Any, module: torch.nn.Module, path: str, shapes: Mapping[str, tuple[int, ...]], report: LoadReport
) -> Any:
    """A module's saved state without the keys it lacks or cannot hold (``strict=False``): those are not read."""
    state = saved.state if isinstance(saved, _StatefulNode) else saved
    if not isinstance(state, dict):
        return saved
    own = module.state_dict()
    out = _like(state)
    for k, v in state.items():
        if k not in own:
            report.unexpected.append(_path_join(path, k))
            continue
        live = own[k]
        if isinstance(v, _Ref) and isinstance(live, torch.Tensor) and tuple(live.shape) != shapes[v.name]:
            _mismatch(report, _path_join(path, k), shapes[v.name], tuple(live.shape))
            continue
        out[k] = v
    return _StatefulNode(saved.type_name, out) if isinstance(saved, _StatefulNode) else out


def _mismatch(report: LoadReport, path: str, stored: tuple[int, ...], live: tuple[int, ...]) -> None:
    report.mismatched.append(path)
    report.details.append(f"{path}: checkpoint {list(stored)}, live {list(live)}")


class Loader:
    """``load_state_dict`` for :func:`tiersave.state.apply_into`: modules load with ``strict=False`` when the
    restore is lenient, and the keys they still miss are reported."""

    def __init__(self, strict: bool, report: LoadReport) -> None:
        self.strict = strict
        self.report = report

    def __call__(self, obj: Any, state: Any, path: str) -> None:
        if self.strict or not isinstance(obj, torch.nn.Module):
            obj.load_state_dict(state)
            return
        result = obj.load_state_dict(state, strict=False)
        left_out = set(self.report.mismatched)  # reported once, as mismatched
        self.report.missing.extend(p for p in (_path_join(path, k) for k in result.missing_keys) if p not in left_out)
        self.report.unexpected.extend(_path_join(path, k) for k in result.unexpected_keys)


def referenced(tree: Any) -> set[str]:
    """The names of the stored tensors a (pruned) tree refers to: the ones to read."""
    names: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, _Ref):
            names.add(node.name)
        elif isinstance(node, _StatefulNode):
            stack.append(node.state)
        elif isinstance(node, dict):
            for value in node.values():  # a tensor's leaf (most of a state) without a trip through the stack
                if type(value) is _Ref:
                    names.add(value.name)
                else:
                    stack.append(value)
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return names


def castable(value: torch.Tensor | np.ndarray, dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a stored tensor of ``dtype`` and ``shape`` may be converted into ``value`` (opt-in cast):
    the same shape, both floating point (an integer is never silently converted)."""
    return (
        isinstance(value, torch.Tensor)
        and tuple(value.shape) == shape
        and value.dtype.is_floating_point
        and torch_dtype(dtype).is_floating_point
    )


def cast_hint(value: torch.Tensor | np.ndarray, dtype: str, shape: tuple[int, ...]) -> str:
    """The advice to append to a dtype-mismatch error."""
    return "; pass cast=True to convert it" if castable(value, dtype, shape) else ""
