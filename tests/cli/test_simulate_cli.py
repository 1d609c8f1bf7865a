"""`tiersave simulate`: the seeds' example end to end, JSON and table, determinism, a plan document and a real
checkpoint root as inputs, replayed failures, the plot, start-up without torch, and bad inputs (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli as run
from helpers import run_cli_json as run_json

SEEDS = [
    "simulate",
    "--size",
    "4.87TB",
    "--accelerators",
    "24000",
    "--cluster-mttf",
    "124min",
    "--restart",
    "5min",
    "--tier",
    "durable,bw=100GB/s",
    "--stage-cost",
    "2s",
    "--period",
    "6.2min",
    "--days",
    "10",
    "--runs",
    "4",
]


def test_seeds_example_json(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, *SEEDS)
    rows = {s["name"]: s for s in doc["strategies"]}
    assert list(rows) == ["fixed", "young", "async", "tiered"]
    for row in rows.values():
        lo, hi = row["goodput_ci95"]
        assert 0 < lo <= row["goodput"] <= hi < 1
        lost = row["lost"]
        assert row["goodput"] + lost["recompute"] + lost["blocked"] + lost["restart"] == pytest.approx(1.0)
    assert rows["fixed"]["goodput"] < rows["young"]["goodput"] < rows["tiered"]["goodput"]
    assert rows["fixed"]["accelerator_hours_saved_vs_fixed_per_day"] == 0
    saved = rows["tiered"]["accelerator_hours_saved_vs_fixed_per_day"]
    assert saved == pytest.approx((rows["tiered"]["goodput"] - rows["fixed"]["goodput"]) * 24_000 * 24)
    assert set(rows["tiered"]["bytes_per_day_by_tier"]) == {"memory", "peer", "durable"}
    # every 6.2 min, a 4.87 TB checkpoint: about 1.1 PB a day, minus the saves lost to failures
    assert rows["fixed"]["bytes_per_day_by_tier"]["durable"] == pytest.approx(4.87e12 * 1440 / 6.2, rel=0.1)
    assert doc["failures_per_day"] == pytest.approx(1440 / 124, rel=0.2)
    assert any("exponential" in line for line in doc["assumptions"])


def test_table_by_default_and_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    code, first, _ = run(capsys, *SEEDS, "--seed", "3")
    assert code == 0
    assert first.splitlines()[1].split()[:3] == ["strategy", "goodput", "95%"]
    assert "tiered" in first and "Assumptions" in first
    _, again, _ = run(capsys, *SEEDS, "--seed", "3")
    _, other, _ = run(capsys, *SEEDS, "--seed", "4")
    assert first == again and first != other


def test_strategy_selection(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, *SEEDS, "--strategy", "tiered", "--strategy", "tiered-nopeer")
    names = [s["name"] for s in doc["strategies"]]
    assert names == ["tiered", "tiered-nopeer"]
    assert all(s["accelerator_hours_saved_vs_fixed_per_day"] is None for s in doc["strategies"])


def test_from_a_plan_document(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    code, out, err = run(
        capsys,
        "plan",
        "--size",
        "4.87TB",
        "--accelerators",
        "24000",
        "--cluster-mttf",
        "124min",
        "--checkpoints-per-mttf",
        "20",
        "--restart",
        "5min",
        "--tier",
        "durable,bw=100GB/s",
        "--json",
    )
    assert code == 0, err
    plan.write_text(out)
    doc = run_json(capsys, "simulate", "--plan", str(plan), "--stage-cost", "2s", "--days", "5", "--runs", "3")
    assert doc["accelerators"] == 24_000
    assert doc["cluster_mttf_s"] == pytest.approx(124 * 60)
    assert doc["checkpoint_bytes"] == 4_870_000_000_000
    fixed = doc["strategies"][0]
    assert fixed["interval_s"] + fixed["blocked_s_per_save"] == pytest.approx(372.0)
    # a flag on the command line wins over the document
    doc = run_json(capsys, "simulate", "--plan", str(plan), "--period", "10min", "--days", "2", "--runs", "2")
    fixed = doc["strategies"][0]
    assert fixed["interval_s"] + fixed["blocked_s_per_save"] == pytest.approx(600.0)


def test_from_a_checkpoint_root(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Real saves into two local tiers; their event log gives the stage cost, the size and the bandwidths."""
    torch = pytest.importorskip("torch")
    import tiersave
    from tiersave.tiers import Tier

    fast, slow = tmp_path / "fast", tmp_path / "slow"
    with tiersave.Checkpointer(tiers=[Tier(str(fast), name="local"), Tier(str(slow), name="durable")]) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((256, 1024), float(step))})
        ckpt.wait()
    root = fast if (fast / "tiersave-events.jsonl").exists() else slow
    doc = run_json(
        capsys, "simulate", "--from", str(root), "--accelerators", "8", "--cluster-mttf", "6h", "--days", "2"
    )
    notes = "\n".join(doc["assumptions"])
    assert "mean time blocked over 3 saves" in notes
    assert doc["checkpoint_bytes"] >= 256 * 1024 * 4
    assert "tier durable:" in notes
    assert [s["name"] for s in doc["strategies"]] == ["fixed", "young", "async", "tiered"]


def test_from_the_manifests_of_a_root_without_an_event_log(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import tiersave

    root = tmp_path / "root"
    with tiersave.Checkpointer(root, event_log=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.ones(64, 1024)})
    assert not (root / "tiersave-events.jsonl").exists()
    argv = ["simulate", "--from", str(root), "--cluster-mttf", "6h", "--storage-bw", "1GB/s", "--days", "2"]
    doc = run_json(capsys, *argv)
    notes = "\n".join(doc["assumptions"])
    assert "mean time blocked over 2 saves" in notes
    assert doc["checkpoint_bytes"] >= 64 * 1024 * 4


def test_replayed_failures(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "failures.txt"
    trace.write_text("# a record\n2h node\n5h crash\n\n9h30min node\n")
    doc = run_json(capsys, *SEEDS[:-4], "--days", "1", "--runs", "2", "--failures", str(trace))
    assert doc["failures_per_day"] == 3
    assert "3 replayed failure times" in doc["failures"]
    lo, hi = doc["strategies"][0]["goodput_ci95"]
    assert lo == hi  # the same trace and kinds every run


def test_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "goodput.png"
    code, out, err = run(capsys, *SEEDS[:-4], "--days", "2", "--runs", "2", "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in out


def test_simulate_imports_no_torch() -> None:
    code = (
        "import sys; from tiersave.cli import main; "
        f"rc = main({[*SEEDS[:-4], '--days', '1', '--runs', '2', '--json']!r}); "
        "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["simulate", "--size", "1TB", "--checkpoint-cost", "30s"], "needs a failure rate"),
        ([*SEEDS, "--node-loss", "1.5"], "--node-loss"),
        ([*SEEDS, "--days", "0"], "--days"),
        ([*SEEDS, "--weibull", "-1"], "Weibull"),
        (["simulate", "--cluster-mttf", "2h", "--strategy", "fixed"], "synchronous save"),
        (["simulate", "--cluster-mttf", "2h", "--checkpoint-cost", "30s", "--strategy", "async"], "checkpoint size"),
        ([*SEEDS, "--period", "30s", "--strategy", "fixed"], "does not fit"),
        (["simulate", "--cluster-mttf", "0s", "--checkpoint-cost", "30s"], "MTTF"),
        (["simulate", "--plan", "/nonexistent/plan.json"], "no such file"),
        (["simulate", "--from", "/nonexistent/root", "--cluster-mttf", "2h"], "no such checkpoint root"),
    ],
)
def test_bad_inputs_exit_2(capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    code, _, err = run(capsys, *extra)
    assert code == 2
    assert message in err


def test_bad_files_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text("{not json")
    code, _, err = run(capsys, "simulate", "--plan", str(bad_plan))
    assert code == 2 and "not a JSON document" in err
    bad_trace = tmp_path / "failures.txt"
    bad_trace.write_text("2h\nsoon\n")
    code, _, err = run(capsys, *SEEDS, "--failures", str(bad_trace))
    assert code == 2 and f"{bad_trace}:2" in err
    empty_root = tmp_path / "root"
    empty_root.mkdir()
    code, _, err = run(capsys, "simulate", "--from", str(empty_root), "--cluster-mttf", "2h")
    assert code == 2 and "no committed saves" in err
    code, _, err = run(capsys, *SEEDS, "--strategy", "bogus")
    assert code == 2 and "invalid choice" in err
