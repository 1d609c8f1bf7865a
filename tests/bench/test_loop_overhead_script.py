"""benchmarks/loop_overhead.py: a tiny run reports every method with the fields docs/benchmarks.md quotes, each
method's checkpoint reads back as the state of the step it was saved at, and the read-back check can fail."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "loop_overhead.py"
ENV = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("loop_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_reports_every_method_and_each_checkpoint_reads_back(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    args = ["--state-mb", "2", "--steps", "4", "--every", "2", "--step-s", "0.01", "--reps", "1", "--allow-few-reps"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["steps"] == 4 and run["every"] == 2 and run["write"] == "touch" and len(run["load_1min"]) == 2
    assert set(run["methods"]) == {"no checkpoint", "tiersave save_async", "tiersave lazy", "DCP async_save",
                                   "torch.save thread"}  # fmt: skip
    for name, m in run["methods"].items():
        for field in ("wall_s", "wall_range_s", "overhead", "overhead_until_durable", "blocked_s", "tail_s"):
            assert field in m, (name, field)
        assert m["verified"] is True and m["reps_not_lazy"] == 0, name
        assert m["saves"] == (0 if name == "no checkpoint" else 2), name  # after steps 1 and 3
    assert set(run["target_met"]) == {"tiersave save_async", "tiersave lazy"}
    assert "| tiersave lazy |" in proc.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tiersave-loop-")]  # the work dir is removed


def test_the_read_back_check_fails_for_a_save_that_let_later_steps_in(tmp_path: Path) -> None:
    mod = _module()
    state = {"a": torch.zeros(1000), "b": torch.ones(17)}
    optim = mod.DeviceStep(state, "touch")

    class Live(mod.Method):  # a "checkpoint" that is the live tensors: no snapshot at all
        name = "live"

        def read(self, step: int, names: list[str]) -> dict[str, torch.Tensor]:
            return {n: self.state[n] for n in names}

    method = Live(tmp_path, state, optim)
    assert mod.verify(method, 4, 4, optim)  # no step after the save: the live state is that step's
    optim.step()
    assert not mod.verify(method, 4, 5, optim)  # one step later the live tensors are not step 4's


def test_fewer_than_three_reps_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--reps", "2"],
        capture_output=True, text=True, timeout=60, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 2 and "at least 3" in proc.stderr
