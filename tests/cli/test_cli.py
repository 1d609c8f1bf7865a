"""The CLI through ``main(argv)``: exit codes, ``--json`` output, and the files it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch

import tiersave
from helpers import listing
from tiersave.cli import main


@pytest.fixture
def populated(root):
    with tiersave.Checkpointer(root) as ckpt:
        for step in (100, 200, 300):
            model = torch.nn.Linear(4, 3)
            torch.nn.init.constant_(model.weight, step)
            state = {"model": model, "bf16": torch.full((2, 2), 1.5, dtype=torch.bfloat16), "step": step}
            ckpt.save(
                step,
                state,
                metrics={"loss": 1000 / step},
                tags=["best"] if step == 200 else [],
                metadata={"run": "test"},
            )
    return root


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_ls_json(capsys, populated):
    code, doc = run_json(capsys, "ls", str(populated))
    assert code == 0
    assert [c["step"] for c in doc["checkpoints"]] == [100, 200, 300]
    assert doc["checkpoints"][1]["tags"] == ["best"] and doc["checkpoints"][1]["metrics"] == {"loss": 5.0}
    assert doc["leftovers"] == [] and doc["damaged"] == []


def test_ls_shows_the_steps_other_processes_are_reading(capsys, populated):
    from tiersave.catalog import Catalog
    from tiersave.storage.posix import LocalStorage

    code, doc = run_json(capsys, "ls", str(populated))
    assert doc["readers"] == []
    with Catalog(LocalStorage(populated)).open(200):  # a reader holding its read lease
        code, doc = run_json(capsys, "ls", str(populated))
        assert code == 0
        assert [(r["step"], r["leases"]) for r in doc["readers"]] == [(200, 1)]
        assert main(["ls", str(populated)]) == 0
        assert "step 200  (1 reader(s))" in capsys.readouterr().out
    code, doc = run_json(capsys, "ls", str(populated))
    assert doc["readers"] == []


def test_ls_reports_a_step_directory_without_its_manifest(capsys, populated):
    (populated / "step-0000000200" / "manifest.json").unlink()
    code, doc = run_json(capsys, "ls", str(populated))
    assert code == 0
    assert [c["step"] for c in doc["checkpoints"]] == [100, 300]
    assert [d["name"] for d in doc["damaged"]] == ["step-0000000200"]
    assert main(["ls", str(populated)]) == 0
    assert "damaged (a step directory without manifest.json" in capsys.readouterr().out


def test_ls_text_and_leftovers(capsys, populated):
    (populated / "step-0000000400.tmp-1-ffffffff-abc").mkdir()
    assert main(["ls", str(populated)]) == 0
    out = capsys.readouterr().out
    assert "loss=10" in out and "best" in out and "step-0000000400.tmp-1-ffffffff-abc" in out


def test_inspect_json(capsys, populated):
    code, doc = run_json(capsys, "inspect", str(populated), "--step", "200")
    assert code == 0
    assert doc["step"] == 200 and doc["metrics"] == {"loss": 5.0} and doc["metadata"] == {"run": "test"}
    names = {t["name"]: t for t in doc["tensors"]}
    assert names["model.weight"]["shape"] == [3, 4] and names["bf16"]["dtype"] == "bfloat16"
    assert doc["tree"]["model"]["object"] == "torch.nn.modules.linear.Linear"
    assert doc["tree"]["step"] == 200
    code, doc = run_json(capsys, "inspect", str(populated), "--tag", "best")
    assert doc["step"] == 200


def test_inspect_text(capsys, populated):
    assert main(["inspect", str(populated)]) == 0
    out = capsys.readouterr().out
    assert "step 300" in out and "model.weight" in out and "float32[3, 4]" in out


def test_verify_ok_and_damaged(capsys, populated):
    code, doc = run_json(capsys, "verify", str(populated), "--all")
    assert code == 0 and doc["ok"] and [r["step"] for r in doc["reports"]] == [100, 200, 300]
    shard = populated / "step-0000000200" / "shard-00000-000.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, doc = run_json(capsys, "verify", str(populated), "--step", "200")
    assert code == 1 and not doc["ok"]
    assert "checksum mismatch in step 200" in doc["reports"][0]["errors"][0]
    assert main(["verify", str(populated)]) == 0  # the newest (300) is intact


@pytest.mark.parametrize("which", [["--all"], []], ids=["all", "newest"])
def test_verify_of_a_root_with_nothing_committed_fails_and_says_so(capsys, tmp_path, which):
    empty = tmp_path / "typo"
    empty.mkdir()
    code, doc = run_json(capsys, "verify", str(empty), *which)
    assert code == 1
    assert "no committed checkpoint" in doc["error"]["message"]


def test_export_is_readable_by_safetensors(capsys, populated, tmp_path):
    out_file = tmp_path / "model.safetensors"
    code, doc = run_json(capsys, "export", str(populated), "--step", "300", "--to", str(out_file))
    assert code == 0 and doc["tensors"] == 3
    tensors = load_torch(str(out_file))
    assert set(tensors) == {"model.weight", "model.bias", "bf16"}
    assert torch.equal(tensors["model.weight"], torch.full((3, 4), 300.0))
    assert tensors["bf16"].dtype == torch.bfloat16
    # --prefix selects and strips: the names a model's load_state_dict expects
    model_file = tmp_path / "weights.safetensors"
    assert main(["export", str(populated), "--prefix", "model.", "--to", str(model_file)]) == 0
    weights = load_numpy(str(model_file))
    assert set(weights) == {"weight", "bias"} and np.all(weights["weight"] == 300.0)
    fresh = torch.nn.Linear(4, 3)
    fresh.load_state_dict(load_torch(str(model_file)))
    # an existing file is not replaced without --force
    assert main(["export", str(populated), "--to", str(out_file)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["export", str(populated), "--to", str(out_file), "--force"]) == 0


def test_export_unsupported_dtype(capsys, root, tmp_path):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"ok": torch.ones(2), "fp8": torch.zeros(2, dtype=torch.float8_e4m3fnuz)})
    dest = tmp_path / "x.safetensors"
    assert main(["export", str(root), "--to", str(dest)]) == 2
    assert "float8_e4m3fnuz, which safetensors cannot store" in capsys.readouterr().err
    assert not dest.exists()
    assert main(["export", str(root), "--to", str(dest), "--skip-unsupported"]) == 0
    assert set(load_torch(str(dest))) == {"ok"}


def test_prune(capsys, populated):
    (populated / "step-0000000400.tmp-999999999-ffffffff-abc").mkdir()  # made on another host: kept
    code, doc = run_json(capsys, "prune", str(populated), "--keep-last", "1", "--dry-run")
    assert code == 0 and doc["deleted"] == [100, 200] and doc["kept"] == [300]
    assert len(listing(populated)) == 4
    code, doc = run_json(capsys, "prune", str(populated), "--keep-last", "1")
    assert doc["deleted"] == [100, 200] and doc["leftovers_removed"] == []
    code, doc = run_json(capsys, "prune", str(populated), "--force")
    assert doc["leftovers_removed"] == ["step-0000000400.tmp-999999999-ffffffff-abc"]
    assert listing(populated) == ["step-0000000300"]


@pytest.mark.parametrize(
    ("argv", "code", "fragment"),
    [
        (["ls", "/nonexistent/root"], 1, "checkpoint root '/nonexistent/root' does not exist"),
        (["inspect", "{root}", "--step", "7"], 1, "no checkpoint of step 7"),
        (["verify", "{root}", "--step", "7"], 1, "no checkpoint of step 7"),
        (["prune", "{root}", "--keep-last", "0"], 2, "must be at least 1"),
        (["ls"], 2, "the following arguments are required: root"),
        (["frobnicate"], 2, "invalid choice"),
        ([], 2, "usage"),
    ],
)
def test_errors_and_exit_codes(capsys, root, argv, code, fragment):
    argv = [a.format(root=root) for a in argv]
    assert main(argv) == code
    captured = capsys.readouterr()
    assert fragment in captured.err


def test_json_errors_are_json(capsys):
    code = main(["ls", "/nonexistent/root", "--json"])
    assert code == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["type"] == "ObjectNotFoundError"


def test_cli_and_file_tools_work_without_torch(tmp_path, populated):
    """ls/inspect/verify/export and the format layer must not import torch (fast start, CPU-only boxes)."""
    code = f"""
import sys
sys.modules['torch'] = None  # any `import torch` now fails
from tiersave.cli import main
for argv in (['ls', {str(populated)!r}], ['inspect', {str(populated)!r}], ['verify', {str(populated)!r}, '--all'],
             ['export', {str(populated)!r}, '--to', {str(tmp_path / "m.safetensors")!r}], ['--help']):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 0, (argv, rc)
import tiersave.format.manifest, tiersave.storage.posix, tiersave.catalog, tiersave.export
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_ls_across_tiers(capsys, tmp_path):
    from tiersave.tiers import Tier

    fast, slow = tmp_path / "fast", tmp_path / "slow"
    with tiersave.Checkpointer(tiers=[Tier(fast, name="fast"), Tier(slow, name="slow", every=2)]) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, {"w": torch.ones(3) * step})
            ckpt.wait()
    code, doc = run_json(capsys, "ls", str(fast), f"file://{slow}")
    assert code == 0
    # two local roots get numbered names, in the order given (fastest first)
    assert [r["name"] for r in doc["roots"]] == ["local0", "local1"]
    assert {c["step"]: c["tiers"] for c in doc["checkpoints"]} == {
        1: ["local0"],
        2: ["local0", "local1"],
        3: ["local0"],
        4: ["local0", "local1"],
    }
    assert main(["ls", str(fast), f"file://{slow}"]) == 0
    assert "tiers" in capsys.readouterr().out


def test_prune_with_a_retention_policy(capsys, root):
    with tiersave.Checkpointer(root) as ckpt:
        for step in range(100, 1100, 100):
            ckpt.save(
                step,
                {"w": torch.ones(2)},
                metrics={"loss": abs(step - 400) / 100},
                tags=["milestone"] if step == 200 else [],
            )
    code, doc = run_json(capsys, "prune", str(root), "--policy", "last=2,best=1:loss:min,tag=milestone", "--dry-run")
    assert code == 0 and doc["kept"] == [200, 400, 900, 1000]
    assert main(["prune", str(root), "--policy", "last=2,best=1:loss:min,tag=milestone"]) == 0
    assert listing(root) == ["step-0000000200", "step-0000000400", "step-0000000900", "step-0000001000"]
    assert main(["prune", str(root), "--policy", "most=3"]) == 2
    assert "unknown retention part 'most'" in capsys.readouterr().err
