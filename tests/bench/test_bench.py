"""`tiersave bench` and tiersave.bench: the workload's shapes, a tiny end-to-end run with every peer
(JSON, table, plot), several ranks, the ratio and target arithmetic on a known document, usage errors,
and start-up without torch. Timing targets are not asserted here: they live in the benchmark itself."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiersave.bench import TARGETS, BenchConfig, gpt_like_spec, summarize
from tiersave.bench.report import plot, ratio
from tiersave.cli import main
from tiersave.engine.memcopy import large_copy
from tiersave.errors import BackendUnavailableError, ConfigError

TINY = ["--size", "2MB", "--checkpoints", "1", "--warmup", "0", "--no-drop-caches", "--quiet"]


@pytest.fixture(autouse=True)
def private_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiersave.storage.posix.calibration import forget_calibrations

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("TIERSAVE_IO_CALIBRATION_BYTES", str(4 << 20))  # a quick calibration
    forget_calibrations()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- the workload ------------------------------------------------------------------------------------


def test_reference_state_is_gpt_like_and_about_3gb() -> None:
    spec = gpt_like_spec("llama3-8b", 3_000_000_000)
    weights = [t for t in spec.tensors if t.name.startswith("model.") or t.name == "lm_head.weight"]
    assert 180 <= len(weights) <= 220  # ~200 fp32 weight tensors ...
    assert len(spec.tensors) == 3 * len(weights)  # ... plus two Adam moments each
    assert abs(spec.nbytes - 3e9) / 3e9 < 0.05
    assert 200e6 < spec.params < 300e6
    names = [t.name for t in spec.tensors]
    assert len(set(names)) == len(names)
    by_name = {t.name: t.shape for t in spec.tensors}
    for w in weights:
        key = w.name.removeprefix("model.")
        assert by_name[f"optim.{key}.exp_avg"] == w.shape == by_name[f"optim.{key}.exp_avg_sq"]
    assert any(t.nbytes % 4096 for t in spec.tensors)  # tensor ends off the 4 KiB grid, as in real models
    assert "llama3-8b scaled" in spec.describe() and spec.to_json()["tensors"] == len(spec.tensors)


def test_other_presets_and_tiny_sizes() -> None:
    gpt = gpt_like_spec("gpt2", 50_000_000)
    names = {t.name for t in gpt.tensors}
    assert "model.embed_positions.weight" in names and "model.layers.0.attn.q_proj.bias" in names
    assert "lm_head.weight" not in names  # tied embeddings
    tiny = gpt_like_spec("llama3-8b", 100_000)
    assert 0.5 < tiny.nbytes / 100_000 < 2.0
    with pytest.raises(ConfigError, match="at least 64 KiB"):
        gpt_like_spec("llama3-8b", 1000)
    with pytest.raises(ConfigError, match="unknown model preset"):
        gpt_like_spec("no-such-model", 10_000_000)


def test_aligned_state_holds_the_same_values_each_tensor_on_a_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from tiersave.bench.workload import build_state, empty_like_state

    spec = gpt_like_spec("llama3-8b", 2_000_000)
    plain, aligned = build_state(spec, seed=3), build_state(spec, seed=3, aligned=True)
    assert any(t.data_ptr() % 4096 for t in plain.values())  # where torch puts them: the case the flag avoids
    assert all(t.data_ptr() % 4096 == 0 and t.is_contiguous() for t in aligned.values())
    assert all(torch.equal(plain[k], aligned[k]) and plain[k].shape == aligned[k].shape for k in plain)
    live = empty_like_state(spec, aligned=True)
    assert all(t.data_ptr() % 4096 == 0 and not t.any() for t in live.values())
    code, out, err = run(
        capsys, "bench", str(tmp_path / "b"), *TINY, "--io", "auto", "--peers", "none", "--aligned-state"
    )
    assert code == 0, err
    assert "every tensor page-aligned (--aligned-state)" in out
    code, out, err = run(
        capsys, "bench", str(tmp_path / "c"), *TINY, "--io", "auto", "--peers", "none", "--no-raw", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["config"]["aligned_state"] is False


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_round_order_puts_each_contender_after_every_other_equally_often(n: int) -> None:
    from collections import Counter
    from itertools import pairwise

    from tiersave.bench.runner import design_rows, round_order

    items = list(range(n))
    rows = design_rows(n)
    assert rows == (2 * n if n % 2 and n > 1 else n)
    orders = [round_order(items, rnd) for rnd in range(rows)]
    assert all(sorted(o) == items for o in orders)  # every round runs every contender once
    places = Counter((item, o.index(item)) for o in orders for item in o)
    assert len(places) == n * n and len(set(places.values())) == 1  # each in every position equally often
    after = Counter(pair for o in orders for pair in pairwise(o))
    # each right after every other one, equally often: what one leaves the next falls on all alike (a
    # rotation puts an item after its two neighbours in the list only)
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1, after
    assert round_order(items, rows + 1) == orders[1 % rows] and round_order(items, -1) == orders[-1]
    assert round_order([], 3) == []


def test_rounds_are_separated_by_an_untimed_eviction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last contender of a round must not always precede the same first contender of the next: between
    rounds the run evicts and pauses, untimed, so the first of a round follows no contender."""
    import tiersave.bench.runner as runner
    from tiersave.bench import BenchConfig

    calls: list[str] = []
    evict = runner.evict
    monkeypatch.setattr(runner, "evict", lambda paths, **kw: calls.append("evict") or evict(paths, **kw))
    real_order = runner.round_order
    monkeypatch.setattr(runner, "round_order", lambda items, rnd: calls.append("round") or real_order(items, rnd))
    from tiersave.bench.methods import TiersaveMethod

    for name in ("save", "load"):
        timed = getattr(TiersaveMethod, name)
        monkeypatch.setattr(TiersaveMethod, name, lambda self, *a, _f=timed, _n=name: calls.append(_n) or _f(self, *a))
    config = BenchConfig(
        directory=tmp_path / "b", size_bytes=2_000_000, checkpoints=2, warmup=1, io_modes=("direct",),
        peers=(), raw=False, drop_caches=False,
    )  # fmt: skip
    runner.run_bench(config)
    rounds = [i for i, c in enumerate(calls) if c == "round"]
    assert len(rounds) == 3 and calls.count("save") == 3 and calls.count("load") == 6
    for i in rounds[1:]:  # after the last load of a round, an eviction of its own, then the next round
        assert calls[i - 2 : i + 3] == ["load", "evict", "round", "evict", "save"]


@pytest.mark.parametrize("replicated", [False, True])
def test_each_rank_builds_its_state_page_aligned_with_aligned_state(replicated: bool) -> None:
    from tiersave.bench.ranks import rank_state

    opts = {"model": "llama3-8b", "size_bytes": 2_000_000, "seed": 0, "replicated": replicated}
    for aligned in (False, True):
        states = [rank_state({**opts, "aligned_state": aligned}, rank, 2) for rank in range(2)]
        tensors = [t for state, _ in states for t in state["model"].values()]
        assert all(t.data_ptr() % 4096 == 0 for t in tensors) is aligned
        owned = [t for _, own in states for t in own]
        assert len(owned) == len(gpt_like_spec("llama3-8b", 2_000_000).tensors)  # each tensor written by one rank


def test_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoints"):
        BenchConfig(directory=tmp_path, checkpoints=0)
    with pytest.raises(ConfigError, match="unknown io mode"):
        BenchConfig(directory=tmp_path, io_modes=("fast",))
    with pytest.raises(ConfigError, match="warmup"):
        BenchConfig(directory=tmp_path, warmup=-1)


# -- end to end --------------------------------------------------------------------------------------


def test_tiny_run_with_every_peer_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "bench.png"
    out_json = tmp_path / "bench.json"
    code, out, err = run(
        capsys, "bench", str(tmp_path / "b"), *TINY, "--json", "--plot", str(png), "--output", str(out_json)
    )
    assert code == 0, err
    data = json.loads(out)
    assert json.loads(out_json.read_text()) == data
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(data["methods"]) == {
        "tiersave-auto",
        "tiersave-direct",
        "tiersave-buffered",
        "tiersave-async",
        "torch",
        "safetensors",
        "dcp",
        "dcp-async",
        "memcpy",
        "dlrover-shm",
        "plain-write",
    }
    for name, m in data["methods"].items():
        assert len(m["save_s"]) == 1 and m["save_s"][0] > 0, name
    # the async save and the yardsticks load nothing; the async save's stall is part of its time to durable
    for name in ("tiersave-async", "memcpy", "dlrover-shm", "plain-write"):
        assert data["methods"][name]["load_s"] == {}, name
    assert data["methods"]["tiersave-async"]["blocked_s"][0] <= data["methods"]["tiersave-async"]["save_s"][0]
    assert data["methods"]["tiersave-async"]["save_stats"][0]["num_tensors"] > 0
    shm = Path(os.environ.get("TIERSAVE_SHM_DIR", "/dev/shm"))  # the run's own (tests/conftest.py)
    assert not list(shm.glob("tiersave-bench-shm-*"))  # the copies' buffer is gone
    assert set(data["methods"]["tiersave-auto"]["load_s"]) == {"new", "into"}
    assert set(data["methods"]["dcp"]["load_s"]) == {"into"}
    assert data["methods"]["dcp-async"]["blocked_s"][0] <= data["methods"]["dcp-async"]["save_s"][0]
    io = data["methods"]["tiersave-direct"]["save_stats"][0]["io"]
    assert io["reasons"] == {"forced-direct": io["reasons"]["forced-direct"]}
    assert set(data["methods"]["tiersave-buffered"]["save_stats"][0]["io"]["paths"]) == {"buffered"}
    assert data["raw"][0]["write_gbps"] and data["raw"][0]["read_gbps"]
    summary = data["summary"]
    assert summary["main"] == "tiersave-auto"
    assert {t["key"] for t in summary["targets"]} == {key for key, _, _ in TARGETS}
    assert data["calibration"]["key"].endswith(data["machine"]["filesystem"])
    assert data["machine"]["stage_copy"] == large_copy()[1]  # the routine the async save staged with
    assert data["eviction"] == "fadvise"
    assert not (tmp_path / "b").exists()  # created by the run, removed by it


def test_text_report_and_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "bench",
        str(tmp_path / "b"),
        "--size",
        "2MB",
        "--checkpoints",
        "1",
        "--warmup",
        "0",
        "--no-drop-caches",
        "--io",
        "auto",
        "--peers",
        "torch",
        "--no-raw",
        "--keep",
    )
    assert code == 0, err
    assert "method" in out and "tiersave-auto" in out and "torch" in out
    assert "save_vs_torch" in out and "targets:" in out
    assert f"staging copy: {large_copy()[1]}" in out
    assert "[#" in err and "done" in err  # the progress bar
    assert any((tmp_path / "b" / "tiersave-auto").iterdir())  # --keep


@pytest.mark.parametrize("replicated", [False, True])
def test_several_ranks_save_one_checkpoint_next_to_dcp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replicated: bool
) -> None:
    flags = ["--replicated", "--aligned-state"] if replicated else []  # the ranks build aligned states too
    code, out, err = run(
        capsys,
        "bench",
        str(tmp_path / "b"),
        *TINY,
        "--io",
        "none",
        "--peers",
        "dcp,dcp-async",
        "--no-raw",
        "--ranks",
        "2",
        *flags,
        "--json",
    )
    assert code == 0, err
    data = json.loads(out)
    ranks = data["ranks"]
    assert ranks["ranks"] == 2 and ranks["replicated"] is replicated
    assert data["config"]["aligned_state"] is replicated
    rnd = ranks["rounds"][0]
    methods = rnd["methods"]
    assert set(methods) == {
        "tiersave-save",
        "tiersave-load",
        "tiersave-async",
        "memcpy",
        "dcp-save",
        "dcp-load",
        "dcp-async",
    }
    state = data["state"]["bytes"]
    for name, m in methods.items():
        assert [r["rank"] for r in m["per_rank"]] == [0, 1], name
        assert m["slowest_s"] == max(r["seconds"] for r in m["per_rank"]), name
        assert m["lowest_rank_gbps"] <= m["gbps"] * 1.0001, name
    # one checkpoint, the state once in total, whether each rank holds a share or the whole (replicated)
    assert methods["tiersave-save"]["bytes"] == state
    assert all(r["bytes"] > 0 for r in methods["tiersave-save"]["per_rank"])
    assert methods["memcpy"]["bytes"] == state  # each rank copies what it writes
    # DCP writes replicated tensors once too (its files add a header per tensor: 40% of this tiny state)
    assert state <= methods["dcp-save"]["bytes"] < state * 1.9
    assert methods["tiersave-load"]["bytes"] == state * (2 if replicated else 1)  # every rank reads all of it
    # the blocked phase and the memcpy also carry the process's CPU seconds; the other methods do not
    for name in ("tiersave-async", "memcpy"):
        assert all(r["cpu_s"] >= 0 for r in methods[name]["per_rank"]), name
    assert "cpu_s" not in methods["tiersave-save"]["per_rank"][0]
    summary = ranks["summary"]
    assert summary["save_vs_dcp"] > 0 and summary["load_vs_dcp"] > 0 and summary["async_blocked_vs_memcpy"] > 0
    job = statistics.median(
        r["methods"]["tiersave-async"]["slowest_s"] / r["methods"]["memcpy"]["slowest_s"] for r in ranks["rounds"]
    )
    assert summary["async_job_blocked_vs_memcpy"] == pytest.approx(job)
    assert summary["async_cpu_vs_memcpy"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--io", "fast"], "unknown io mode"),
        (["--peers", "pickle"], "unknown peer"),
        (["--checkpoints", "0"], "at least 1"),
        (["--size", "lots"], "cannot read"),
        (["--io", "none", "--peers", "none"], "nothing to run"),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _, err = run(capsys, "bench", str(tmp_path / "b"), *argv)
    assert code == 2
    assert message in err


def test_a_second_run_in_a_directory_another_run_uses_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every run removes its methods' and ranks' directories when it starts and ends: a second run in the same
    # directory deleted a collective save of the first midway (rank 0 found its own shard gone at the commit).
    directory = tmp_path / "b"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # what a run holds for its whole length: an exclusive flock(2) on the directory
            "import fcntl, os, sys; os.mkdir(sys.argv[1]); fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
            str(directory),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        code, _, err = run(capsys, "bench", str(directory), *TINY, "--io", "buffered", "--peers", "none", "--no-raw")
        assert code == 2 and "in use by another tiersave bench run" in err, err
    finally:
        holder.communicate(timeout=60)
    assert holder.returncode == 0
    assert run(capsys, "bench", str(directory), *TINY, "--io", "buffered", "--peers", "none", "--no-raw")[0] == 0


def test_check_flag_fails_on_a_missed_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiersave.bench

    class Fake:
        def to_json(self) -> dict[str, Any]:
            data = document()
            data["summary"] = summarize(data)
            return data

    monkeypatch.setattr(tiersave.bench, "run_bench", lambda config, progress=None: Fake())
    assert run(capsys, "bench", str(tmp_path), "--quiet")[0] == 0
    assert run(capsys, "bench", str(tmp_path), "--quiet", "--check")[0] == 1


def test_help_points_at_the_benchmarks_doc_that_explains_the_targets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "bench", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "docs/benchmarks.md" in text and "DESIGN.md" not in text
    doc = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for _, what, _ in TARGETS:  # the doc the help cites lists every target the report checks
        assert what in doc


def test_cli_module_imports_without_torch() -> None:
    code = "import sys, tiersave.cli.bench_cmd, tiersave.bench; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the arithmetic ----------------------------------------------------------------------------------


def document() -> dict[str, Any]:
    """A run of 1 GB where every time is chosen so the ratios are round numbers."""
    gb = 1_000_000_000

    def method(family: str, save: float, loads: dict[str, float], blocked: float | None = None) -> dict[str, Any]:
        return {
            "family": family,
            "save_s": [save, save],
            "blocked_s": [blocked or save] * 2,
            "load_s": {k: [v, v] for k, v in loads.items()},
            "save_stats": [],
        }

    return {
        "config": {"directory": "/x", "checkpoints": 2, "warmup": 1},
        "machine": {"filesystem": "ext4", "device": "254:0", "cpus": 2, "kernel": "k"},
        "state": {"preset": "llama3-8b", "params": 83_000_000, "tensors": 603, "bytes": gb},
        "calibration": None,
        "eviction": "drop_caches",
        "raw": [
            {"write_gbps": {"direct x1": 2.0, "direct x4": 1.0}, "read_gbps": {"direct x1": 2.0, "buffered x4": 1.0}},
            {"write_gbps": {"direct x1": 2.0, "direct x4": 1.0}, "read_gbps": {"direct x1": 2.0, "buffered x4": 1.0}},
        ],
        "methods": {
            "tiersave-auto": method("tiersave", 0.5, {"new": 1.0, "into": 0.5}),  # 2 GB/s save, 1 and 2 GB/s load
            "tiersave-direct": method("tiersave", 0.5, {"new": 1.0, "into": 0.5}),
            "tiersave-buffered": method("tiersave", 2.0, {"new": 0.8, "into": 0.8}),
            "torch": method("peer", 1.0, {"new": 2.0}),
            "dcp": method("peer", 4.0, {"into": 0.5}),
            "dcp-async": method("peer", 2.0, {}, blocked=0.25),
        },
        "ranks": None,
        "notes": [],
    }


def test_summary_takes_medians_with_the_range_and_holds_stalls_against_the_copies() -> None:
    data = document()
    data["methods"]["tiersave-auto"]["save_s"] = [0.5, 4.0, 0.25]  # median 0.5 s: 2 GB/s, not the mean's
    data["methods"]["tiersave-async"] = {
        "family": "tiersave-async", "save_s": [0.6, 0.6], "blocked_s": [0.1, 0.3], "load_s": {}, "save_stats": [],
    }  # fmt: skip
    for name, seconds in (("memcpy", 0.1), ("dlrover-shm", 0.4), ("plain-write", 1.0)):
        data["methods"][name] = {
            "family": "reference", "save_s": [seconds] * 2, "blocked_s": [seconds] * 2, "load_s": {}, "save_stats": [],
        }  # fmt: skip
    s = summarize(data)
    auto = s["methods"]["tiersave-auto"]
    assert auto["save_gbps"] == pytest.approx(2.0)
    assert auto["save_range_gbps"] == pytest.approx([0.25, 4.0])
    assert auto["load_range_gbps"]["new"] == pytest.approx([1.0, 1.0])
    assert s["methods"]["tiersave-async"]["blocked_s"] == pytest.approx(0.2)
    assert s["methods"]["tiersave-async"]["blocked_range_s"] == pytest.approx([0.1, 0.3])
    assert s["main"] == "tiersave-auto"  # the async save is not the main method
    r = s["ratios"]
    assert r["async_stall_vs_dlrover"] == pytest.approx(2.0)  # 0.4 s against 0.2 s
    assert r["async_stall_vs_memcpy"] == pytest.approx(0.5)
    assert r["buffered_save_vs_plain_write"] == pytest.approx(0.5)  # 2.0 s against 1.0 s
    met = {t["key"]: t["met"] for t in s["targets"]}
    assert met["async_stall_vs_dlrover"] and not met["buffered_save_vs_plain_write"]


def test_summary_ratios_and_targets() -> None:
    s = summarize(document())
    assert s["raw"]["write_gbps"] == pytest.approx(2.0) and s["raw"]["write_config"] == "direct x1"
    assert s["raw"]["read_gbps"] == pytest.approx(2.0)
    assert s["methods"]["tiersave-auto"]["save_gbps"] == pytest.approx(2.0)
    assert s["methods"]["dcp-async"]["blocked_s"] == pytest.approx(0.25)
    r = s["ratios"]
    assert r["save_vs_raw_write"] == pytest.approx(1.0)
    assert r["save_vs_torch"] == pytest.approx(2.0)
    assert r["save_vs_dcp"] == pytest.approx(8.0)
    assert r["restore_into_vs_raw_read"] == pytest.approx(1.0)
    assert r["restore_new_vs_torch"] == pytest.approx(2.0)
    assert r["restore_into_vs_dcp"] == pytest.approx(1.0)
    assert r["auto_vs_best_load_new"] == pytest.approx(0.8)  # buffered took 0.8 s, auto 1.0 s
    assert r["save_vs_safetensors"] is None  # not run
    met = {t["key"]: t["met"] for t in s["targets"]}
    assert met["save_vs_raw_write"] and met["save_vs_torch"] and not met["restore_into_vs_dcp"]
    assert not met["restore_new_vs_raw_read"]  # 1 GB/s vs 2
    assert not met["auto_vs_best_load_new"] and met["auto_vs_best_save"]


def test_text_report_renders_a_stored_document() -> None:
    from tiersave.cli.bench_cmd import render_text

    data = document()
    data["summary"] = summarize(data)
    text = render_text(data)
    assert "[MISSED] restore (into live state) vs DCP load: 1.00x" in text
    assert "[met] save vs torch.save+fsync: 2.00x" in text
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = document()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(BackendUnavailableError, match=r"tiersave\[bench\]"):
        plot(data, str(tmp_path / "x.png"))


def test_raw_measurement_where_direct_io_is_refused_is_buffered_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiersave.bench import device

    monkeypatch.setattr(device, "open_direct", lambda path, flags: None)  # as a file system without O_DIRECT
    raw = device.measure_raw(tmp_path, 3 << 20, streams=(1, 2), block_bytes=1 << 20, drop_caches=False)
    assert raw.direct_refused
    assert set(raw.write) == {"buffered x1", "buffered x2"} and set(raw.read) == {"buffered x2"}
    assert not list(tmp_path.iterdir())  # the raw file is gone
    data = document()
    data["raw"] = [{"write_gbps": raw.write, "read_gbps": raw.read}]
    s = summarize(data)
    assert s["raw"]["write_config"] == max(raw.write, key=raw.write.__getitem__)
    assert s["raw"]["read_config"] == "buffered x2"
