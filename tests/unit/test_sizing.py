"""Checkpoint sizing: parameter counts of the presets, recipes, per-rank layout, measuring real state."""

from __future__ import annotations

import doctest

import pytest

from tiersave.errors import ConfigError
from tiersave.planner.architecture import PRESETS, Architecture, get_preset
from tiersave.planner.recipes import RECIPES, get_recipe
from tiersave.planner.sizing import Parallelism, checkpoint_size, measure_state
from tiersave.units import format_si_bytes, parse_bytes, parse_count

GiB = 2**30


def _llama_count(layers: int, hidden: int, ffn: int, heads: int, vocab: int = 128_256, *, tied: bool = False) -> int:
    """Llama parameter count written out by hand: q and o are h x h, k and v are h x (8 * head_dim)."""
    kv = 8 * (hidden // heads)
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * layer + hidden


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3-8b", _llama_count(32, 4096, 14_336, 32)),
        ("llama3-70b", _llama_count(80, 8192, 28_672, 64)),
        ("llama3-405b", _llama_count(126, 16_384, 53_248, 128)),
        ("llama3.2-1b", _llama_count(16, 2048, 8192, 32, tied=True)),
        # Hugging Face's published counts for the GPT-2 checkpoints (tied head, biases, learned positions).
        ("gpt2", 124_439_808),
        ("gpt2-xl", 1_557_611_200),
    ],
)
def test_preset_parameter_count_matches_hand_count(name: str, expected: int) -> None:
    assert get_preset(name).param_count == expected


@pytest.mark.parametrize(
    ("name", "billions"),
    [("llama3-8b", 8.0), ("llama3-70b", 70.6), ("llama3-405b", 405.9), ("gpt3-175b", 174.6)],
)
def test_preset_lands_on_published_size(name: str, billions: float) -> None:
    assert round(PRESETS[name].param_count / 1e9, 1) == billions


def test_llama3_70b_weights_only_bf16_is_about_130_gib() -> None:
    size = checkpoint_size("llama3-70b", "bf16-weights-only")
    assert size.total_bytes == 2 * 70_553_706_496
    assert 130 <= size.total_bytes / GiB < 132  # 131.4 GiB


def test_llama3_405b_training_state_is_about_5_tb() -> None:
    # 12 bytes/param (fp32 master + two fp32 Adam moments) is what yields the literature's 1.1 PB/day.
    master = checkpoint_size("llama3-405b", "bf16-adam-master")
    assert master.total_bytes == 12 * 405_853_388_800
    assert format_si_bytes(master.total_bytes) == "4.87 TB"
    # Keeping the bf16 working copy too (14 bytes/param) gives 5.7 TB.
    mixed = checkpoint_size("llama3-405b", "bf16-adam-mixed")
    assert mixed.total_bytes == 14 * 405_853_388_800
    assert format_si_bytes(mixed.total_bytes) == "5.68 TB"


def test_recipe_bytes_per_param() -> None:
    assert {name: r.bytes_per_param for name, r in RECIPES.items()} == {
        "bf16-weights-only": 2,
        "fp32-weights-only": 4,
        "fp32-adam": 12,
        "bf16-adam-master": 12,
        "bf16-adam-mixed": 14,
        "bf16-adam-mixed-grads": 16,
    }


def test_custom_recipe_spec_equals_preset() -> None:
    custom = get_recipe("weights=bf16, master=fp32, moments=fp32+fp32")
    assert [c.bytes_per_param for c in custom.components] == [2, 4, 4, 4]
    assert [c.role for c in custom.components] == ["weights", "master", "moment", "moment"]
    assert checkpoint_size(1000, custom).total_bytes == checkpoint_size(1000, "bf16-adam-mixed").total_bytes == 14_000
    eight_bit = get_recipe("weights=2,moments=1+1")
    assert eight_bit.bytes_per_param == 4
    assert get_recipe(" BF16-Adam-Mixed ") is RECIPES["bf16-adam-mixed"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("adam", "known recipes: bf16-weights-only"),
        ("weights=0", "must be > 0"),
        ("weights=-2", "must be > 0"),
        ("weights=bf17", "neither a dtype"),
        ("optimizer=4", "KEY in weights, grads, master, moments"),
        ("weights=2,weights=4", "weights given twice"),
    ],
)
def test_bad_recipe_is_a_config_error(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        get_recipe(spec)


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        get_preset("llama4-2t")
    assert "unknown model preset 'llama4-2t'" in str(info.value)
    for name in PRESETS:
        assert name in str(info.value)


@pytest.mark.parametrize("params", [0, -5, True, 1.5])
def test_non_positive_parameter_count_is_rejected(params: object) -> None:
    with pytest.raises(ConfigError):
        checkpoint_size(params, "fp32-adam")  # type: ignore[arg-type]


def test_architecture_validates_its_fields() -> None:
    with pytest.raises(ConfigError, match="layers must be a positive integer"):
        Architecture(name="x", layers=0, hidden=64, ffn_hidden=256, heads=4, kv_heads=4, vocab=100)
    with pytest.raises(ConfigError, match="not divisible by heads"):
        Architecture(name="x", layers=2, hidden=65, ffn_hidden=256, heads=4, kv_heads=4, vocab=100)
    with pytest.raises(ConfigError, match="not divisible by kv_heads"):
        Architecture(name="x", layers=2, hidden=64, ffn_hidden=256, heads=4, kv_heads=3, vocab=100)


# ------------------------------------------------------------------------------------------------ per rank


def test_zero_stages_shard_the_right_components() -> None:
    params = 8_000  # tp=2, dp=4, no pipeline: a raw parameter count splits evenly
    tp_shard = params // 2

    def held(stage: int) -> list[int]:
        size = checkpoint_size(params, "bf16-adam-mixed-grads", Parallelism(tp=2, dp=4, zero_stage=stage))
        assert size.rank_written_bytes == params * 16 // 8  # replicas split the writing at every stage
        return [c.rank_held_bytes for c in size.components]

    # components: weights bf16, grads bf16, master fp32, exp_avg fp32, exp_avg_sq fp32
    assert held(0) == [2 * tp_shard, 2 * tp_shard, 4 * tp_shard, 4 * tp_shard, 4 * tp_shard]
    assert held(1) == [2 * tp_shard, 2 * tp_shard, tp_shard, tp_shard, tp_shard]
    assert held(2) == [2 * tp_shard, tp_shard // 2, tp_shard, tp_shard, tp_shard]
    assert held(3) == [tp_shard // 2, tp_shard // 2, tp_shard, tp_shard, tp_shard]


def test_pipeline_stages_put_embeddings_at_the_ends_and_extra_layers_in_the_middle() -> None:
    arch = PRESETS["llama3-405b"]
    stages = arch.stage_params(16)  # 126 layers: 14 stages of 8, the first and last of 7
    layer = arch.layer_params
    embed = 128_256 * 16_384
    assert stages[0] == 7 * layer + embed
    assert stages[-1] == 7 * layer + embed + 16_384  # output head and final norm
    assert set(stages[1:-1]) == {8 * layer}
    assert sum(stages) == arch.param_count
    # A tied head keeps a copy of the embedding on the last stage.
    tied = PRESETS["gpt2"]
    assert sum(tied.stage_params(4)) == tied.param_count + 50_257 * 768


def test_per_rank_size_uses_the_heaviest_stage() -> None:
    layout = Parallelism.for_world(16_384, tp=8, pp=16, zero_stage=1)
    assert (layout.tp, layout.pp, layout.dp) == (8, 16, 128)
    size = checkpoint_size("llama3-405b", "bf16-adam-mixed", layout)
    heaviest = 8 * PRESETS["llama3-405b"].layer_params
    # bf16 weights replicated over dp; fp32 master and moments sharded over dp (ZeRO-1)
    assert size.components[0].rank_held_bytes == heaviest * 2 // 8
    assert size.components[1].rank_held_bytes == -(-heaviest * 4 // (8 * 128))
    assert size.rank_written_bytes == -(-heaviest * 14 // (8 * 128))
    assert any("pipeline stages hold" in a for a in size.assumptions)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Parallelism.for_world(100, tp=8), "does not divide the 100 ranks"),
        (lambda: Parallelism(tp=0), "tp must be a positive integer"),
        (lambda: Parallelism(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
        (lambda: checkpoint_size("llama3-8b", "fp32-adam", Parallelism(tp=3)), "tp=3 does not divide the 32"),
        (
            lambda: checkpoint_size("llama3-8b", "fp32-adam", Parallelism(pp=33)),
            "pp=33 exceeds the 32 layers",
        ),
    ],
)
def test_inconsistent_parallelism_is_a_config_error(call: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()  # type: ignore[operator]


def test_every_output_states_its_assumptions() -> None:
    size = checkpoint_size("llama3-70b", "bf16-adam-mixed", Parallelism(tp=8, dp=2, zero_stage=3))
    text = "\n".join(size.assumptions)
    assert "70,553,706,496 parameters" in text
    assert "weights (bf16) 2 + master (fp32) 4 + exp_avg (fp32) 4 + exp_avg_sq (fp32) 4 = 14 bytes/param" in text
    assert "ZeRO-3 (FSDP)" in text
    assert "tensor parallelism splits every parameter 8 ways" in text


# --------------------------------------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("5TB", 5 * 10**12), ("130GiB", 130 * GiB), ("13GB/s", 13 * 10**9), ("1.5 kib", 1536)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["0", "-1GB", "5XB", "", "0.1"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(text)


@pytest.mark.parametrize(("text", "value"), [("405B", 405 * 10**9), ("124M", 124 * 10**6), ("70.6e9", 70_600_000_000)])
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["0", "-3B", "lots"])
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_count(text)


def test_format_si_bytes() -> None:
    assert format_si_bytes(512) == "512 B"
    assert format_si_bytes(13.092e9, "/s") == "13.1 GB/s"
    assert format_si_bytes(1.1312e15) == "1.13 PB"
    assert format_si_bytes(141.1e9) == "141 GB"


# -------------------------------------------------------------------------------------------- measurement


def test_measure_numpy_arrays_counts_shared_views_once() -> None:
    np = pytest.importorskip("numpy")
    base = np.zeros((10, 10), dtype=np.float32)
    state = {"a": base, "same": base, "b": [np.ones(5, dtype=np.float16)], "meta": {"step": 3, "name": "x"}}
    m = measure_state(state)
    assert (m.tensors, m.numel, m.total_bytes) == (3, 205, 400 + 400 + 10)
    assert m.unique_bytes == 410
    assert dict(m.bytes_by_dtype) == {"float32": 800, "float16": 10}


def test_measure_rejects_cycles() -> None:
    state: dict[str, object] = {}
    state["self"] = state
    with pytest.raises(ConfigError, match="cycle"):
        measure_state(state)


@pytest.fixture(scope="module")
def torch():
    """torch, imported only by the tests that measure real tensors."""
    return pytest.importorskip("torch")


def _meta_llama(torch, arch: Architecture):
    """A Llama-shaped module written independently of the sizing formula, built on the meta device."""
    nn = torch.nn
    h, kv = arch.hidden, arch.kv_heads * arch.head_dim

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False)
            self.v, self.o = nn.Linear(h, kv, bias=False), nn.Linear(h, h, bias=False)
            self.gate = nn.Linear(h, arch.ffn_hidden, bias=False)
            self.up = nn.Linear(h, arch.ffn_hidden, bias=False)
            self.down = nn.Linear(arch.ffn_hidden, h, bias=False)
            self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(arch.vocab, h)
            self.blocks = nn.ModuleList(Block() for _ in range(arch.layers))
            self.norm = nn.RMSNorm(h)
            self.head = nn.Linear(h, arch.vocab, bias=False)
            if arch.tied_embeddings:
                self.head.weight = self.embed.weight

    with torch.device("meta"):
        return Model().to(torch.bfloat16)


@pytest.mark.parametrize("name", ["llama3-8b", "llama3.2-1b"])
def test_measure_meta_model_agrees_with_preset(torch, name: str) -> None:
    arch = PRESETS[name]
    m = measure_state(_meta_llama(torch, arch))
    # Shared storage is counted once: the tied head of llama3.2-1b is not a second copy.
    assert m.unique_bytes == 2 * arch.param_count
    tied_extra = arch.vocab * arch.hidden if arch.tied_embeddings else 0
    assert m.numel == arch.param_count + tied_extra
    assert dict(m.bytes_by_dtype) == {"bfloat16": m.total_bytes}


def test_measure_real_model_and_optimizer_state(torch) -> None:
    model = torch.nn.Linear(4, 3)  # 12 weights + 3 biases, fp32
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    m = measure_state({"model": model, "optim": optim})
    # model 15 x 4 B; Adam: exp_avg and exp_avg_sq (15 x 4 B each) plus one fp32 "step" scalar per parameter
    assert m.total_bytes == 60 + 120 + 2 * 4
    assert m.tensors == 2 + 2 * 3
    # state_dict tensors share storage with the parameters they came from
    shared = measure_state({"a": model.state_dict(), "b": model.state_dict()})
    assert (shared.total_bytes, shared.unique_bytes) == (120, 60)


def test_docstring_examples_run() -> None:
    import tiersave.planner.sizing

    result = doctest.testmod(tiersave.planner.sizing)
    assert result.attempted >= 3
    assert result.failed == 0
