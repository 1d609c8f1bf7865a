"""Every example in examples/ runs end to end at smoke size, as a user would run it (a subprocess with a time
limit): a first run stops early, a second run of the same command resumes from the newest checkpoint."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LIMIT_S = 240


def env(tmp_path: Path) -> dict[str, str]:
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), out.get("PYTHONPATH", "")])
    out["TIERSAVE_SHM_DIR"] = str(tmp_path / "shm")  # the memory tier of the test, not the user's /dev/shm
    return out


def start(tmp_path: Path, *argv: str) -> subprocess.Popen[str]:
    # Its own session: a torchrun agent and its workers are stopped as one group.
    return subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(tmp_path),
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], limit_s: float = LIMIT_S) -> str:
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"{proc.args} ran past {limit_s} s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]
    return out


def run(tmp_path: Path, script: str, *args: str) -> str:
    return finish(start(tmp_path, str(EXAMPLES / script), *args))


@pytest.mark.timeout(3 * LIMIT_S)
def test_train_loop_resumes_and_a_watcher_serves_each_checkpoint(tmp_path):
    watcher = start(
        tmp_path, str(EXAMPLES / "serve_watch.py"), "--dir", str(tmp_path), "--until", "60", "--timeout", "120"
    )
    try:
        # Every 2nd step saved to RAM, every 5th save copied to disk (what the watcher follows): 20, then 30..60,
        # unless a slow disk widened that tier's cadence (then it ends at the newest save it was sent).
        train = ("train_loop.py", "--dir", str(tmp_path), "--steps", "60", "--save-every", "2")
        first = run(tmp_path, *train, "--stop-at", "20")
        assert "stopped at step 20" in first
        second = run(tmp_path, *train)
        assert "resuming from step 20" in second and "tier memory" in second and "stopped at step 60" in second
    except BaseException:
        os.killpg(watcher.pid, signal.SIGKILL)
        watcher.communicate(timeout=30)
        raise
    on_disk = ast.literal_eval(second.split("checkpoints held: ", 1)[1].strip().splitlines()[0])["local"]
    assert on_disk and max(on_disk) >= 30, second  # a save of the resumed run reached the disk
    served = finish(watcher)  # --until 60: otherwise it stops 120 s after the last new checkpoint
    steps = [int(s) for s in re.findall(r"serving step (\d+)", served)]
    assert steps and steps == sorted(steps) and steps[-1] == max(on_disk), (served, on_disk)
    model_bytes = {int(n) for n in re.findall(r"\((\d+) bytes read\)", served)}
    assert len(model_bytes) == 1, served  # the model's tensors only, the same every time


@pytest.mark.timeout(2 * LIMIT_S)
def test_torchrun_job_resumes_on_every_rank(tmp_path):
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    job = str(EXAMPLES / "torchrun_job.py")
    first = finish(start(tmp_path, *torchrun, job, "--dir", str(tmp_path), "--steps", "40", "--stop-at", "20"))
    assert "newest checkpoint: step 20, saved by 2 ranks" in first
    second = finish(start(tmp_path, *torchrun, job, "--dir", str(tmp_path), "--steps", "40"))
    assert "rank 0: resuming from step 20" in second and "rank 1: resuming from step 20" in second
    assert "newest checkpoint: step 40, saved by 2 ranks" in second


@pytest.mark.timeout(LIMIT_S)
def test_transfer_learning_takes_the_encoder_and_reports_the_new_head(tmp_path):
    out = run(tmp_path, "transfer_learning.py", "--dir", str(tmp_path), "--steps", "60")
    assert "shape-mismatched, left as initialized: ['model.head.weight', 'model.head.bias']" in out
    assert "without cast=True: model.encoder.0.weight: the live value is bfloat16" in out
    assert "with cast=True: 4 tensors converted to bfloat16" in out
    read = re.findall(r"read (\d+) bytes \(the encoder only\)", out)
    assert read and f"({read[0]} bytes read)" in out  # keys=['model.encoder'] read the same bytes


@pytest.mark.timeout(LIMIT_S)
def test_early_stopping_restores_the_best(tmp_path):
    out = run(tmp_path, "early_stopping.py", "--dir", str(tmp_path), "--patience", "2")
    best = re.findall(r"step (\d+): val_loss ([0-9.]+) \(best\)", out)[-1]
    assert f"restored the best checkpoint, step {best[0]}: val_loss {best[1]}" in out
    assert f"{best[0]} (best)" in out.rsplit("kept: ", 1)[1]


@pytest.mark.timeout(2 * LIMIT_S)
def test_hf_trainer_example_stops_then_resumes(tmp_path):
    pytest.importorskip("transformers")
    first = run(tmp_path, "hf_trainer.py", "--dir", str(tmp_path), "--epochs", "1", "--stop-at", "10")
    assert "stopped at step 10" in first
    second = run(tmp_path, "hf_trainer.py", "--dir", str(tmp_path), "--epochs", "1")
    assert "resuming from step 10" in second and "stopped at step 20" in second


@pytest.mark.timeout(2 * LIMIT_S)
def test_lightning_example_stops_then_resumes(tmp_path):
    pytest.importorskip("lightning")
    first = run(tmp_path, "lightning_fit.py", "--dir", str(tmp_path), "--epochs", "1")
    assert "epoch 1, step 16" in first
    second = run(tmp_path, "lightning_fit.py", "--dir", str(tmp_path), "--epochs", "2")
    assert "epoch 2, step 32" in second
    # Stored: exactly the steps the .ckpt pointers name (Lightning keeps the last.ckpt it resumed from and
    # writes last-v1.ckpt; the old best pointer was rotated out).
    named = {json.loads(p.read_text())["step"] for p in (tmp_path / "ckpt").glob("*.ckpt")}
    stored = {int(s) for s in second.rsplit("stored steps: ", 1)[1].split(",")}
    assert stored == named and 32 in named


@pytest.mark.timeout(3 * LIMIT_S)
def test_the_watcher_serves_the_step_a_movable_tag_points_to(tmp_path):
    run(tmp_path, "train_loop.py", "--dir", str(tmp_path), "--steps", "20", "--save-every", "2")
    disk = str(tmp_path / "ckpt")
    steps = json.loads(run_cli(tmp_path, "ls", disk, "--json"))["checkpoints"]
    tagged = steps[0]["step"]  # an older one: the watcher must serve it, not the newest
    run_cli(tmp_path, "tag", disk, str(tagged), "serving")
    out = run(tmp_path, "serve_watch.py", "--dir", str(tmp_path), "--tag", "serving", "--until", "0", "--timeout", "60")
    assert re.findall(r"serving step (\d+)", out) == [str(tagged)]


def run_cli(tmp_path: Path, *args: str) -> str:
    return finish(start(tmp_path, "-m", "tiersave.cli", *args))
