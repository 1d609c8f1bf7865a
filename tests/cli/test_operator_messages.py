"""What an operator sees on a root that holds nothing, or step directories that are no checkpoint."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import tiersave
import tiersave.cli
from tiersave.cli import main


def test_ls_and_verify_on_a_root_with_nothing_committed_exit_1_saying_so(capsys, root):
    assert main(["ls", str(root)]) == 1
    assert f"no committed checkpoint in {root.as_uri()}" in capsys.readouterr().out
    assert main(["ls", str(root), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["checkpoints"] == []
    assert main(["verify", str(root)]) == 1
    assert "no committed checkpoint" in capsys.readouterr().err
    assert main(["verify", str(root), "--json"]) == 1
    assert "ok" not in json.loads(capsys.readouterr().out)


def test_restore_warns_once_naming_the_step_directories_it_skipped(root):
    with tiersave.Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((2,), float(step))})
    (root / "step-0000000003" / "manifest.json").unlink()  # damaged: the newest, without its manifest
    shutil.copytree(root / "step-0000000001", root / "step-0000000009")  # made by hand...
    (root / "step-0000000009" / "manifest.json").unlink()  # ...and incomplete
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = tiersave.Checkpointer(root).restore()
    assert torch.equal(state["w"], torch.full((2,), 2.0))  # the newest real checkpoint
    ours = [w for w in caught if issubclass(w.category, tiersave.TiersaveWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "2 damaged step directories" in message
    assert f"{root.as_uri()}/step-0000000003" in message and f"{root.as_uri()}/step-0000000009" in message


def test_restore_of_a_clean_root_warns_nothing(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiersave.Checkpointer(root).restore()


@pytest.mark.parametrize("argv", [["ls"], ["verify"]])
def test_a_typo_in_the_root_is_an_error_not_an_empty_listing(capsys, tmp_path, argv):
    assert main([*argv, str(tmp_path / "no-such-run")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_stats_plot_puts_each_run_on_its_own_axis(root, tmp_path, capsys):
    from tiersave.cli.stats_cmd import split_runs

    with tiersave.Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.ones(2)})
    with tiersave.Checkpointer(root) as ckpt:  # a resumed run saves steps it saved before: a new run
        ckpt.prune(keep_last=1)
        for step in (4, 5):
            ckpt.save(step, {"w": torch.ones(2)})
    from tiersave.events import EVENTS_NAME, read_events

    runs = split_runs(read_events(root / EVENTS_NAME))
    assert [[e["step"] for e in run] for run in runs] == [[1, 2, 3, 4, 5]]  # steps went on: one run
    t = 1.7e9
    events = [{"step": s, "outcome": "committed", "time": t + s, "blocked_s": 0.001} for s in (1, 2, 3)]
    events += [{"step": 2, "tier": "s3", "outcome": "drained", "time": t + 2.5}]  # a drain is not a save
    events += [{"step": s, "outcome": "committed", "time": t + 10 + s, "blocked_s": 0.002} for s in (2, 3)]
    events += [{"step": 9, "outcome": "committed", "time": t + 9000, "blocked_s": 0.002}]  # hours later
    assert [[e["step"] for e in run] for run in split_runs(events)] == [[1, 2, 3], [2, 3], [9]]
    png = tmp_path / "blocked.png"
    assert tiersave.cli.main(["stats", str(root), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().out


def _cli_stderr(argv: list[str], *, tty: bool) -> str:
    """Run the CLI in a child process with its stderr on a pseudo-terminal (tty) or a pipe; its stderr."""
    import os
    import pty
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "tiersave.cli", *argv]
    if not tty:
        done = subprocess.run(cmd, capture_output=True, env=env, timeout=120, check=True)
        return done.stderr.decode()
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=slave, env=env)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=120) == 0
    finally:
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


@pytest.fixture
def sizable(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.ones(3 << 20)})  # 12 MiB
    return root


def test_verify_copy_and_export_show_byte_progress_on_a_terminal_only(sizable, tmp_path):
    export = ["export", str(sizable), "--to", str(tmp_path / "w.safetensors"), "--force"]
    for argv in (["verify", str(sizable)], ["copy", str(sizable), str(tmp_path / "copy")], export):
        shown = _cli_stderr(argv, tty=True)
        total = "24.00 MiB" if argv[0] == "copy" else "12.00 MiB"  # copy counts the write and the read back
        assert "\rstep 1 [" in shown and f"{total} / {total} 100%" in shown, shown
        assert "step 1 [" not in _cli_stderr([*argv[:1], "--json", *argv[1:]], tty=True)  # --json: nothing extra
        if argv[0] == "copy":
            (tmp_path / "copy" / "step-0000000001").rename(tmp_path / "copy" / "step-0000000001.trash-x")
        assert "step 1 [" not in _cli_stderr(argv, tty=False)  # piped: no bar


def test_stats_skips_event_lines_no_writer_could_have_written(root, capsys):
    """A damaged line that reads as NaN or an infinite number is skipped like a torn one: kept, it made
    ``stats --json`` fail to print (strict JSON out)."""
    from tiersave.events import EVENTS_NAME, read_events

    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
    log = root / EVENTS_NAME
    good = len(read_events(log))
    with log.open("a", encoding="utf-8") as f:
        f.write('{"step": 2, "outcome": "committed", "total_s": NaN}\n')
        f.write('{"step": 3, "outcome": "committed", "total_s": 1e999}\n')
        f.write('{"step": 4, "outcome": "comm')  # torn
    assert len(read_events(log)) == good
    assert main(["stats", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
