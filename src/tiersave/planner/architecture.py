"""How many parameters a model has: a decoder-only transformer architecture and the named presets.

Scope: the exact parameter count of a decoder-only transformer from its shape (layers, width, MLP width,
attention and key/value heads, vocabulary, gated MLP, tied embeddings, biases, LayerNorm or RMSNorm,
learned positions), its split over pipeline stages (:meth:`Architecture.stage_params`), and the presets
``llama3.2-1b`` ... ``gpt3-175b`` with the sources of their numbers (:data:`PRESETS`, :func:`get_preset`).

Anti-scope: bytes per parameter (:mod:`tiersave.planner.recipes`), per-rank sizes
(:mod:`tiersave.planner.sizing`), other model families (give a parameter count instead), torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from ._checks import require_count

__all__ = ["PRESETS", "Architecture", "get_preset"]


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
            require_count(f"{self.name}: {attr}", getattr(self, attr))
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
        require_count("pp", pp)
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
