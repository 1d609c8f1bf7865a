"""`tiersave plan`: the literature figures end to end, JSON output, errors and exit codes, the sweep and
its plot, start-up without torch, and the worked examples in docs/planning.md."""

from __future__ import annotations

import doctest
import itertools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli as run
from helpers import run_cli_json as run_json
from tiersave.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "planning.md"
LITERATURE = [
    "plan",
    "--model",
    "llama3-405b",
    "--recipe",
    "bf16-adam-master",
    "--accelerators",
    "24000",
    "--cluster-mttf",
    "124min",
    "--checkpoints-per-mttf",
    "20",
]


def test_literature_figures_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, *LITERATURE)
    assert data["size"]["total_bytes"] == 12 * 405_853_388_800
    assert data["size"]["bytes_per_param"] == 12
    interval = data["interval"]
    assert interval["cluster_mttf_s"] == 124 * 60
    assert interval["period_s"] == pytest.approx(372.0)  # a checkpoint every 6.2 minutes
    assert interval["checkpoints_per_day"] == pytest.approx(232.26, abs=0.01)
    assert interval["goodput"] is None  # no checkpoint cost given
    bandwidth = data["bandwidth"]
    assert bandwidth["bytes_per_day"] == pytest.approx(1.1312e15, rel=1e-4)  # about 1.1 PB a day
    assert bandwidth["bytes_per_s"] == pytest.approx(13.09e9, rel=1e-3)  # about 13 GB/s
    assert bandwidth["bytes_per_s_per_accelerator"] == pytest.approx(13.092e9 / 24_000, rel=1e-3)
    assert any("12 bytes/param" in line for line in data["assumptions"])


def test_literature_figures_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *LITERATURE)
    assert code == 0
    assert "6.2 min (20 per MTTF)" in out
    assert re.search(r"checkpoints per day\s+232\.3", out)
    assert "4.87 TB every 6.2 min = 232.3 checkpoints, 1.13 PB per day; 13.1 GB/s sustained" in out
    assert "Assumptions\n- model llama3-405b" in out


def test_weights_only_70b_is_about_130_gib(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--model", "llama3-70b", "--recipe", "bf16-weights-only")
    assert code == 0
    assert re.search(r"total\s+2\s+141 GB \(131\.42 GiB\)", out)
    assert "1 accelerator (default; give --accelerators)" in out


def test_daly_plan_with_tiers_and_restart(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(
        capsys,
        "plan",
        "--size",
        "1TB",
        "--accelerators",
        "1000",
        "--cluster-mttf",
        "1h",
        "--checkpoint-cost",
        "2s",
        "--restart",
        "10min",
        "--formula",
        "young",
        "--tier",
        "memory,bw=100GB/s",
        "--tier",
        "durable,every=2,bw=2GB/s",
    )
    interval = data["interval"]
    assert (interval["young_interval_s"], interval["interval_s"], interval["period_s"]) == (120.0, 120.0, 122.0)
    assert interval["daly_interval_s"] == pytest.approx(118.670370, abs=1e-6)
    assert interval["goodput"] == pytest.approx(0.967034 * 2.718281828 ** (-600 / 3600), abs=1e-6)
    memory, durable = data["bandwidth"]["tiers"]
    assert (memory["drain_s"], memory["keeps_up"], memory["min_every"]) == (10.0, True, 1)
    # 500 s to drain, 244 s between the checkpoints it gets: needs every 5th (5 x 122 = 610 s)
    assert (durable["drain_s"], durable["keeps_up"], durable["min_every"]) == (500.0, False, 5)
    assert durable["required_bytes_per_s"] == pytest.approx(1e12 / 244)


def test_checkpoint_cost_defaults_to_a_synchronous_write_to_the_slowest_tier(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = run_json(capsys, "plan", "--size", "1TB", "--cluster-mttf", "4h", "--storage-bw", "10GB/s")
    assert data["interval"]["cost_s"] == 100.0
    assert any("a synchronous save" in line for line in data["assumptions"])


def test_failure_sources(capsys: pytest.CaptureFixture[str]) -> None:
    components = run_json(
        capsys,
        "plan",
        "--accelerators",
        "10000",
        "--component",
        "gpu=10000@20000h",
        "--component",
        "host=1250@10000h",
        "--checkpoint-cost",
        "60s",
    )
    assert components["interval"]["cluster_mttf_s"] == pytest.approx(1.6 * 3600)  # 1 / (0.5 + 0.125) h
    observed = run_json(capsys, "plan", "--observed", "419,54,16384", "--accelerators", "24000", "--period", "10min")
    assert observed["interval"]["cluster_mttf_s"] / 60 == pytest.approx(126.69, abs=0.01)
    assert observed["interval"]["period_s"] == 600.0
    unscaled = run_json(capsys, "plan", "--observed", "419,54,16384", "--checkpoints-per-mttf", "10")
    assert unscaled["interval"]["accelerators"] == 16_384
    single = run_json(capsys, "plan", "--accelerator-mttf", "50000h", "--checkpoint-cost", "30s")
    assert single["interval"]["cluster_mttf_s"] == 50_000 * 3600  # one accelerator


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama4"], "unknown model preset 'llama4'; known presets: llama3.2-1b, llama3-8b"),
        (["--model", "llama3-8b", "--recipe", "adam"], "known recipes: bf16-weights-only"),
        (["--size=-5GB"], "cannot read '-5GB' as a byte quantity"),
        (["--size", "0"], "a byte quantity must be at least 1"),
        (["--params", "0"], "a parameter count must be at least 1"),
        (["--cluster-mttf", "0"], "cluster MTTF must be a positive"),
        (["--cluster-mttf=-3h"], "cannot read '-3h' as a duration"),
        (["--model", "llama3-8b", "--accelerators", "12", "--tp", "8"], "tp=8 x pp=1 = 8 does not divide the 12"),
        (["--model", "llama3-8b", "--tp", "3"], "tp=3 does not divide the 32 attention heads"),
        (["--accelerators", "0", "--cluster-mttf", "1h"], "--accelerators must be at least 1"),
        ([], "nothing to plan"),
        (["--cluster-mttf", "1h"], "needs the checkpoint cost"),
        (["--cluster-mttf", "1h", "--checkpoint-cost", "2h", "--period", "1h"], "does not fit in a period"),
        (["--observed", "419,54"], "expected N,DAYS,G"),
        (["--component", "gpu@5h"], "expected NAME=COUNT@MTTF"),
        (["--size", "1TB", "--cluster-mttf", "1h", "--tier", "disk,speed=3"], "unknown option 'speed=3'"),
        (["--cluster-mttf", "1h", "--checkpoint-cost", "1s", "--plot", "x.png"], "use 'tiersave plan sweep"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2
    assert err.startswith("tiersave: error: ")
    assert message in err
    assert out == ""


def test_error_with_json_is_a_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--model", "nope", "--json")
    assert code == 2
    assert json.loads(out)["error"]["type"] == "ConfigError"


def test_usage_errors_from_argparse_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--zero", "5"]) == 2
    assert main(["plan", "--cluster-mttf", "1h", "--accelerator-mttf", "5h"]) == 2  # one failure source
    assert main(["plan", "bogus"]) == 2
    capsys.readouterr()


def test_help_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0
    assert "examples:" in out
    assert "tiersave plan sweep --accelerator-mttf 50000h" in out


def test_presets(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "plan", "presets")
    params = {m["name"]: m["params"] for m in data["models"]}
    assert params["llama3-405b"] == 405_853_388_800
    assert params["gpt2"] == 124_439_808
    recipes = {r["name"]: r["bytes_per_param"] for r in data["recipes"]}
    assert recipes["bf16-adam-mixed"] == 14


def test_sweep_halves_mttf_per_doubling(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(
        capsys, "plan", "sweep", "--accelerator-mttf", "50000h", "--checkpoint-cost", "30s", "--size", "1TB"
    )
    points = data["points"]
    assert [p["accelerators"] for p in points] == [2**k for k in range(3, 18)]  # default 8:131072, 15 points
    for small, large in itertools.pairwise(points):
        assert large["cluster_mttf_s"] == pytest.approx(small["cluster_mttf_s"] / 2)
        assert large["young_interval_s"] == pytest.approx(small["young_interval_s"] / 2**0.5)
        assert large["goodput"] < small["goodput"]
    first = points[0]
    assert first["cluster_mttf_s"] == 50_000 * 3600 / 8
    assert first["bytes_per_s"] == pytest.approx(1e12 / first["period_s"])


def test_sweep_needs_a_failure_rate(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "sweep", "--size", "1TB")
    assert code == 2
    assert "a sweep needs a failure rate" in err
    code, _, err = run(capsys, "plan", "sweep", "--accelerator-mttf", "5y", "--checkpoint-cost", "1s", "--range", "9:3")
    assert code == 2
    assert "1 <= MIN <= MAX" in err
    code, _, err = run(capsys, "plan", "sweep", "--cluster-mttf", "2h", "--checkpoint-cost", "1s")
    assert code == 2
    assert "give --accelerators for the cluster" in err
    data = run_json(capsys, "plan", "sweep", "--cluster-mttf", "2h", "--accelerators", "1024", "--period", "5min")
    assert data["accelerator_mttf_s"] == 2 * 3600 * 1024


def test_sweep_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "sweep.png"
    code, out, err = run(
        capsys, "plan", "sweep", "--accelerator-mttf", "50000h", "--checkpoint-cost", "30s", "--plot", str(target)
    )
    assert code == 0, err
    assert f"wrote {target}" in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert target.stat().st_size > 10_000  # two panels with lines, not an empty canvas


def test_plot_without_matplotlib_names_the_extra(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run(
        capsys,
        "plan",
        "sweep",
        "--accelerator-mttf",
        "5y",
        "--checkpoint-cost",
        "1s",
        "--plot",
        str(tmp_path / "p.png"),
    )
    assert code == 1
    assert "pip install 'tiersave[bench]'" in err
    assert not (tmp_path / "p.png").exists()


def test_plan_starts_without_torch_or_numpy() -> None:
    script = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "import tiersave.planner.architecture, tiersave.planner.recipes, tiersave.planner.sizing\n"
        "import tiersave.planner.failures, tiersave.planner.interval\n"
        "import tiersave.planner.bandwidth, tiersave.planner.schedule\n"
        "from tiersave.cli import main\n"
        f"code = main({[*LITERATURE, '--json']!r})\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'matplotlib')"
        " and sys.modules[m] is not None]\n"
        "assert not loaded, loaded\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["bandwidth"]["bytes_per_s"] == pytest.approx(13.09e9, rel=1e-3)


# ------------------------------------------------------------------------------------------------- docs

_CONSOLE = re.compile(r"```console\n\$ (tiersave [^\n]*)\n(.*?)```", re.S)


def _console_blocks() -> list[tuple[str, str]]:
    return _CONSOLE.findall(DOCS.read_text())


def test_docs_have_worked_examples() -> None:
    commands = [cmd for cmd, _ in _console_blocks()]
    assert len(commands) >= 4
    assert any("--checkpoints-per-mttf 20" in cmd for cmd in commands)


@pytest.mark.parametrize(
    ("command", "expected"), _console_blocks(), ids=[f"example{i}" for i in range(1, len(_console_blocks()) + 1)]
)
def test_docs_console_examples_match_the_cli(capsys: pytest.CaptureFixture[str], command: str, expected: str) -> None:
    code, out, err = run(capsys, *shlex.split(command)[1:])
    assert code == 0, err
    printed = [line.rstrip() for line in out.rstrip("\n").split("\n")]
    assert printed == expected.rstrip("\n").split("\n")


def test_docs_python_examples_run() -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(DOCS.read_text(), {}, "planning.md", str(DOCS), 0)
    assert len(test.examples) >= 5
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
