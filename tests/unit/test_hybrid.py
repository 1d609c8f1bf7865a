"""storage.posix.policy and .calibration: the auto policy's decision for every documented case, knobs,
statistics, and the calibration (measured for real on a small size, cached per file system under $XDG_CACHE_HOME)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tiersave import knobs
from tiersave.errors import ConfigError
from tiersave.storage.posix import calibration as io_calibration
from tiersave.storage.posix import filesystem_type
from tiersave.storage.posix import policy as io_policy
from tiersave.storage.posix.calibration import (
    Calibration,
    cache_path,
    calibrate,
    calibration_for,
    forget_calibrations,
)
from tiersave.storage.posix.directio import refuse_direct_io
from tiersave.storage.posix.policy import IOMode, IOPolicy, IOStats, io_mode_from_env, parse_io_mode

MiB = 1 << 20


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private calibration cache, and no calibration unless a test asks for one."""
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("TIERSAVE_IO_CALIBRATE", "0")
    monkeypatch.delenv("TIERSAVE_IO", raising=False)
    monkeypatch.delenv("TIERSAVE_DIRECT_MIN_BYTES", raising=False)
    forget_calibrations()
    yield cache
    forget_calibrations()


def cal(dw: float = 2.0, bw: float = 0.3, dr: float = 1.8, br: float = 1.2, memcpy: float = 10.0) -> Calibration:
    return Calibration("254:0:ext4", dw, bw, dr, br, memcpy, 128 * MiB, 4, 0.0)


def policy(mode: str = "auto", fstype: str = "ext4", calibration: Calibration | None = None) -> IOPolicy:
    return IOPolicy(parse_io_mode(mode), Path("/nonexistent"), fstype, min_direct_bytes=MiB, calibration=calibration)


# -- modes and knobs ---------------------------------------------------------------------------------


def test_parse_io_mode() -> None:
    assert parse_io_mode("AUTO") is IOMode.AUTO
    assert parse_io_mode(" direct ") is IOMode.DIRECT
    assert parse_io_mode(IOMode.BUFFERED) is IOMode.BUFFERED
    assert str(IOMode.DIRECT) == "direct"
    with pytest.raises(ConfigError, match="auto, direct, buffered"):
        parse_io_mode("fast")


def test_env_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert io_mode_from_env() is IOMode.AUTO
    monkeypatch.setenv("TIERSAVE_IO", "buffered")
    assert io_mode_from_env() is IOMode.BUFFERED
    monkeypatch.setenv("TIERSAVE_IO", "sideways")
    with pytest.raises(ConfigError, match="TIERSAVE_IO='sideways'"):
        io_mode_from_env()
    monkeypatch.setenv("TIERSAVE_DIRECT_MIN_BYTES", "4096")
    assert io_policy.direct_min_bytes() == 4096
    monkeypatch.setenv("TIERSAVE_DIRECT_MIN_BYTES", "lots")
    with pytest.raises(ConfigError, match="not an integer"):
        io_policy.direct_min_bytes()
    monkeypatch.setenv("TIERSAVE_BOUNCE_BYTES", "5000")
    with pytest.raises(ConfigError, match="multiple of 4096"):
        io_policy.bounce_bytes()
    for raw, expected in (("1", "on"), ("off", "off"), ("refresh", "refresh")):
        monkeypatch.setenv("TIERSAVE_IO_CALIBRATE", raw)
        assert io_calibration.calibration_setting() == expected
    monkeypatch.setenv("TIERSAVE_IO_CALIBRATE", "maybe")
    with pytest.raises(ConfigError, match="TIERSAVE_IO_CALIBRATE"):
        io_calibration.calibration_setting()


def test_override_env_restores_the_previous_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSAVE_IO", "direct")
    with knobs.override_env("TIERSAVE_IO", "buffered"):
        assert io_mode_from_env() is IOMode.BUFFERED
    assert os.environ["TIERSAVE_IO"] == "direct"


# -- decisions: one test per documented rule ---------------------------------------------------------


def test_forced_buffered_wins_over_everything() -> None:
    d = policy("buffered", calibration=cal()).decide("write", 1 << 30, aligned=True)
    assert (d.path, d.reason) == ("buffered", "forced-buffered")
    assert not policy("buffered").wants_direct()


def test_refused_fs_is_buffered_even_when_direct_is_forced() -> None:
    for mode in ("auto", "direct"):
        p = policy(mode, calibration=cal())
        assert p.wants_direct()
        p.mark_refused("EINVAL on open(O_DIRECT)")
        p.mark_refused("a second refusal is ignored")
        assert p.refused == "EINVAL on open(O_DIRECT)"
        d = p.decide("read", 1 << 30, aligned=True)
        assert (d.path, d.reason) == ("buffered", "direct-refused")
        assert not p.wants_direct()


def test_forced_direct_for_any_size_and_alignment() -> None:
    p = policy("direct", fstype="tmpfs")
    assert p.wants_direct()
    for op in ("read", "write"):
        d = p.decide(op, 1, aligned=False)  # type: ignore[arg-type]
        assert (d.path, d.reason) == ("direct", "forced-direct")


@pytest.mark.parametrize("fstype", ["tmpfs", "ramfs"])
def test_auto_on_memory_file_systems_is_buffered(fstype: str) -> None:
    p = policy(fstype=fstype, calibration=cal())
    assert not p.wants_direct()  # the memory tier never even opens a direct descriptor
    d = p.decide("write", 1 << 30, aligned=True)
    assert (d.path, d.reason) == ("buffered", "memory-fs")


def test_auto_small_reads_are_buffered_small_writes_are_not() -> None:
    p = policy(calibration=cal())
    small = p.decide("read", MiB - 1, aligned=True)
    assert (small.path, small.reason) == ("buffered", "small")
    big = p.decide("read", MiB, aligned=True)
    assert (big.path, big.reason) == ("direct", "calibrated")
    # Writes to one file never mix paths (ext4's inode lock): a small write follows the file's choice.
    w = p.decide("write", 100, aligned=False)
    assert (w.path, w.reason) == ("direct", "calibrated")


def test_auto_follows_the_calibration() -> None:
    slow_direct = cal(dw=0.5, bw=1.0, dr=0.5, br=1.0)
    for op in ("read", "write"):
        d = policy(calibration=slow_direct).decide(op, 64 * MiB, aligned=True)  # type: ignore[arg-type]
        assert (d.path, d.reason) == ("buffered", "calibrated")
        assert "buffered 1.00 GB/s" in d.detail
    # Within 5%, direct wins: it spares the page cache.
    close = cal(dw=1.0, bw=1.04, dr=1.0, br=1.04)
    assert policy(calibration=close).decide("read", 64 * MiB, aligned=True).path == "direct"
    assert policy(calibration=cal(dr=1.0, br=1.06)).decide("read", 64 * MiB, aligned=True).path == "buffered"


def test_auto_charges_unaligned_reads_one_memcpy() -> None:
    # direct 2.0 GB/s, memcpy 4 GB/s: through a bounce buffer 1/(1/2 + 1/4) = 1.33 GB/s < buffered 1.5
    c = cal(dr=2.0, br=1.5, memcpy=4.0)
    assert c.direct_gbps("read", aligned=False) == pytest.approx(4 / 3)
    assert policy(calibration=c).decide("read", 64 * MiB, aligned=True).path == "direct"
    d = policy(calibration=c).decide("read", 64 * MiB, aligned=False)
    assert (d.path, d.reason) == ("buffered", "calibrated")
    assert "(bounce)" in d.detail
    # Writes ignore alignment (one path per file).
    assert policy(calibration=cal(dw=2.0, bw=1.5, memcpy=4.0)).decide("write", 64 * MiB, aligned=False).path == "direct"


def test_auto_without_calibration_goes_direct_on_block_devices() -> None:
    p = policy()  # TIERSAVE_IO_CALIBRATE=0 (fixture)
    d = p.decide("write", 64 * MiB, aligned=True)
    assert (d.path, d.reason) == ("direct", "uncalibrated")


def test_policy_validates_its_mode() -> None:
    with pytest.raises(ConfigError):
        IOPolicy("quick", Path("/"), "ext4")  # type: ignore[arg-type]


# -- statistics --------------------------------------------------------------------------------------


def test_io_stats_record_merge_and_json() -> None:
    a, b = IOStats(), IOStats()
    a.record("direct", 100, 0.5)
    a.note("calibrated")
    b.record("direct", 50, 0.25)
    b.record("buffered", 7, 0.1)
    b.note("small")
    b.note("small")
    a.merge(b)
    data = a.to_json()
    assert data["paths"] == {
        "direct": {"bytes": 150, "seconds": 0.75, "calls": 2},
        "buffered": {"bytes": 7, "seconds": 0.1, "calls": 1},
    }
    assert data["reasons"] == {"calibrated": 1, "small": 2}
    assert a.bytes_by_path() == {"direct": 150, "buffered": 7}
    assert a.paths["direct"].gbps == pytest.approx(150 / 0.75 / 1e9)
    copy = a.copy()
    copy.record("direct", 1, 0.0)
    assert a.paths["direct"].bytes == 150  # a real copy
    assert "direct" in repr(a)


def test_io_stats_are_thread_safe() -> None:
    stats = IOStats()

    def work() -> None:
        for _ in range(1000):
            stats.record("direct", 1, 0.0)
            stats.note("r")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.paths["direct"].bytes == 8000 and stats.reasons["r"] == 8000


# -- calibration -------------------------------------------------------------------------------------


def test_calibration_json_round_trip_and_rejects_junk() -> None:
    c = cal()
    assert Calibration.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert Calibration.from_json({**c.to_json(), "version": 99}) is None
    assert Calibration.from_json({**c.to_json(), "direct_read_gbps": -1}) is None
    assert Calibration.from_json({"version": 1}) is None
    assert Calibration.from_json("nonsense") is None


def test_calibrate_measures_both_paths_and_cleans_up(tmp_path: Path) -> None:
    if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("needs a block-device file system")
    c = calibrate(tmp_path, fstype="ext4", nbytes=8 * MiB, block_bytes=MiB, threads=2, rounds=1)
    assert c is not None
    for rate in (c.direct_write_gbps, c.buffered_write_gbps, c.direct_read_gbps, c.buffered_read_gbps):
        assert 0 < rate < 1000
    assert c.memcpy_gbps > 0 and c.nbytes == 8 * MiB and c.key.endswith(":ext4")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tiersave-calibrate")] == []


def test_calibrate_removes_probes_of_dead_calibrations(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f".tiersave-calibrate-{int(dead.stdout)}-abc.direct"
    alive = tmp_path / f".tiersave-calibrate-{os.getppid()}-abc.direct"
    orphan.write_bytes(b"x")
    alive.write_bytes(b"x")
    with refuse_direct_io():
        assert calibrate(tmp_path, nbytes=MiB, block_bytes=MiB, rounds=1) is None
    assert not orphan.exists() and alive.exists()


def test_calibrate_returns_none_where_o_direct_is_refused(tmp_path: Path) -> None:
    with refuse_direct_io():
        assert calibrate(tmp_path, nbytes=MiB, block_bytes=MiB, rounds=1) is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tiersave-calibrate")] == []


def test_calibration_is_measured_once_then_cached_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_cache: Path
) -> None:
    calls: list[Path] = []

    def fake(directory: Path, *, fstype: str = "", **_: object) -> Calibration:
        calls.append(Path(directory))
        return Calibration(io_calibration.fs_key(directory, fstype), 2.0, 0.3, 1.8, 1.2, 10.0, MiB, 4, 1.0)

    monkeypatch.setattr(io_calibration, "calibrate", fake)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    assert calibration_for(data_dir, "ext4", measure=False) is None
    first = calibration_for(data_dir, "ext4")
    assert first is not None and len(calls) == 1
    assert calibration_for(data_dir, "ext4") == first and len(calls) == 1  # this process remembers
    assert cache_path() == isolated_cache / "tiersave" / "io-calibration.json"
    stored = json.loads(cache_path().read_text())
    assert stored[first.key]["direct_write_gbps"] == 2.0
    forget_calibrations()
    assert calibration_for(data_dir, "ext4") == first and len(calls) == 1  # read back from the disk cache
    calibration_for(data_dir, "ext4", refresh=True)
    assert len(calls) == 2


def test_policy_looks_the_calibration_up_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSAVE_IO_CALIBRATE", "1")
    looked: list[str] = []

    def fake_for(directory: Path, fstype: str, *, refresh: bool = False, measure: bool = True) -> Calibration:
        looked.append(fstype)
        return cal(dw=0.1, bw=1.0)

    monkeypatch.setattr(io_policy, "calibration_for", fake_for)
    p = IOPolicy(IOMode.AUTO, tmp_path, "ext4", min_direct_bytes=MiB)
    assert p.decide("read", 10, aligned=True).reason == "small"
    assert looked == []  # small reads never need it
    assert p.decide("write", 64 * MiB, aligned=True).path == "buffered"
    p.decide("write", 64 * MiB, aligned=True)
    assert looked == ["ext4"]


def test_unwritable_cache_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    io_calibration._store_cache(cal())  # logs at debug level, raises nothing
    assert io_calibration._load_cache() == {}
