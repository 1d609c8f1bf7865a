"""The benchmark's training state: a GPT-like dict of fp32 weights plus Adam moments, scaled to a size.

Scope: shapes of a decoder-only transformer taken from a :mod:`tiersave.planner.architecture` preset and
scaled down (fewer layers, a narrower width and vocabulary, same proportions) until weights plus two fp32 Adam moments
weigh a target number of bytes; materializing that state as CPU tensors filled with incompressible data.
The spec is torch-free; :func:`build_state` imports torch.

The state is a flat ``{name: tensor}`` dict, so every peer (torch.save, safetensors, DCP) takes it as is:
``model.<param>`` for the weights and ``optim.<param>.exp_avg`` / ``.exp_avg_sq`` for the moments, as in
MLPerf Storage's checkpointing workload (model and optimizer state of an LLM, fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..planner.architecture import Architecture, get_preset

if TYPE_CHECKING:
    import torch

__all__ = ["StateSpec", "TensorSpec", "build_state", "empty_like_state", "gpt_like_spec"]

_BYTES_PER_PARAM = 12  # fp32 weight + fp32 exp_avg + fp32 exp_avg_sq
_TARGET_PARAM_TENSORS = 200


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the state: its name and shape (always fp32)."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


@dataclass(frozen=True, slots=True)
class StateSpec:
    """The scaled model: its dimensions and every tensor of the state (weights, then moments)."""

    preset: str
    layers: int
    hidden: int
    ffn_hidden: int
    vocab: int
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors if t.name.startswith("model."))

    def describe(self) -> str:
        return (
            f"{self.preset} scaled: {self.layers} layers, hidden {self.hidden}, ffn {self.ffn_hidden}, "
            f"vocab {self.vocab}; {self.params / 1e6:.1f}M fp32 params + Adam moments, "
            f"{len(self.tensors)} tensors"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "layers": self.layers,
            "hidden": self.hidden,
            "ffn_hidden": self.ffn_hidden,
            "vocab": self.vocab,
            "params": self.params,
            "tensors": len(self.tensors),
            "bytes": self.nbytes,
        }


def _param_shapes(arch: Architecture, layers: int, hidden: int, ffn: int, vocab: int) -> list[TensorSpec]:
    kv = max(8, hidden * arch.kv_heads // arch.heads)
    out = [TensorSpec("model.embed_tokens.weight", (vocab, hidden))]
    if arch.max_positions:
        out.append(TensorSpec("model.embed_positions.weight", (arch.max_positions, hidden)))
    norm = ["weight", "bias"] if arch.layernorm else ["weight"]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [TensorSpec(f"{p}.input_norm.{w}", (hidden,)) for w in norm]
        for name, rows in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv), ("o_proj", hidden)):
            out.append(TensorSpec(f"{p}.attn.{name}.weight", (rows, hidden)))
            if arch.bias:
                out.append(TensorSpec(f"{p}.attn.{name}.bias", (rows,)))
        out += [TensorSpec(f"{p}.post_norm.{w}", (hidden,)) for w in norm]
        mlp = [("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden))] if arch.gated_mlp else []
        mlp = mlp or [("up_proj", (ffn, hidden))]
        mlp.append(("down_proj", (hidden, ffn)))
        for name, shape in mlp:
            out.append(TensorSpec(f"{p}.mlp.{name}.weight", shape))
            if arch.bias:
                out.append(TensorSpec(f"{p}.mlp.{name}.bias", (shape[0],)))
    out += [TensorSpec(f"model.norm.{w}", (hidden,)) for w in norm]
    if not arch.tied_embeddings:
        out.append(TensorSpec("lm_head.weight", (vocab, hidden)))
    return out


def gpt_like_spec(preset: str = "llama3-8b", target_bytes: int = 3_000_000_000) -> StateSpec:
    """The preset's architecture scaled so that weights + two Adam moments (12 B/param) weigh about
    ``target_bytes``, with about 200 weight tensors (fewer layers than a big preset has).

    Width, MLP width and vocabulary shrink by the same factor, so the mix of large matrices and small
    vectors (norms, biases) keeps the original proportions; a vocabulary that is not a multiple of 1024
    leaves tensor ends off the 4 KiB grid, as real ones do.

    Raises:
        ConfigError: unknown preset or a target below 64 KiB.
    """
    if target_bytes < 64 * 1024:
        raise ConfigError(f"benchmark state size must be at least 64 KiB, got {target_bytes} B")
    arch = get_preset(preset)
    per_layer = len(_param_shapes(arch, 1, 64, 64, 64)) - len(_param_shapes(arch, 0, 64, 64, 64))
    fixed = len(_param_shapes(arch, 0, 64, 64, 64))
    layers = max(1, min(arch.layers, round((_TARGET_PARAM_TENSORS - fixed) / per_layer)))
    target_params = target_bytes / _BYTES_PER_PARAM

    def build(layers: int, hidden: int) -> tuple[int, int, int, int]:
        scale = hidden / arch.hidden
        ffn = max(8, round(arch.ffn_hidden * scale / 8) * 8)
        vocab = max(8, round(arch.vocab * scale))
        params = sum(t.numel for t in _param_shapes(arch, layers, hidden, ffn, vocab))
        return params, hidden, ffn, vocab

    while True:
        best = build(layers, 8)
        for hidden in range(16, arch.hidden + 1, 8):
            if best[0] > target_params:
                break
            cand = build(layers, hidden)
            if abs(cand[0] - target_params) < abs(best[0] - target_params):
                best = cand
            if cand[0] > target_params:
                break
        if best[0] <= 1.5 * target_params or layers == 1:
            break
        layers = max(1, layers // 2)  # even the narrowest width is too big: fewer layers
    _, hidden, ffn, vocab = best
    weights = _param_shapes(arch, layers, hidden, ffn, vocab)
    moments = [
        TensorSpec(f"optim.{t.name.removeprefix('model.')}.{m}", t.shape)
        for m in ("exp_avg", "exp_avg_sq")
        for t in weights
    ]
    return StateSpec(arch.name, layers, hidden, ffn, vocab, tuple(weights + moments))


def _empty(shape: tuple[int, ...], aligned: bool) -> torch.Tensor:
    """An uninitialized fp32 CPU tensor: where torch's allocator puts it, or at a page boundary."""
    import torch

    if not aligned:
        return torch.empty(shape, dtype=torch.float32)
    nbytes = 4 * math.prod(shape)
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    return raw[skip : skip + nbytes].view(torch.float32).view(shape)


def build_state(spec: StateSpec, *, seed: int = 0, aligned: bool = False) -> dict[str, torch.Tensor]:
    """Allocate the state as contiguous CPU fp32 tensors filled with random (incompressible) values (each at
    a page boundary when ``aligned``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for t in spec.tensors:
        # uniform_ is ~5x faster than randn and just as incompressible.
        state[t.name] = _empty(t.shape, aligned).uniform_(-1.0, 1.0, generator=gen)
    return state


def empty_like_state(spec: StateSpec, *, aligned: bool = False) -> dict[str, torch.Tensor]:
    """Same shapes, zero-filled (so the memory is touched, as a live training state is)."""
    return {t.name: _empty(t.shape, aligned).zero_() for t in spec.tensors}
