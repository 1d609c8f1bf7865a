"""The streaming copy staging uses (engine/memcopy.py, engine/_streamcopy.c) and the wheel build that compiles it.

The copy is checked byte for byte against its inputs at every size and alignment its code branches on (below and
around the size it hands to ``memmove``, the unaligned head, the whole blocks, the tail), with guard bytes on both
sides; the build is run for real with hatchling on a copy of the project, with and without a compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tiersave.engine import memcopy, stage
from tiersave.engine.stage import HostCopier
from tiersave.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SMALL = 256 << 10  # _streamcopy.c: copies below this go to memmove
LIBRARY = "tiersave/engine/_streamcopy.so"

needs_stream = pytest.mark.skipif(not memcopy.stream_available(), reason="the streaming copy was not built here")


def _can_build() -> bool:
    cc = (os.environ.get("CC") or "cc").split()[0]
    return sys.platform == "linux" and platform.machine() == "x86_64" and shutil.which(cc) is not None


def test_the_streaming_copy_is_built_and_used_where_it_can_be(monkeypatch):
    """An install on Linux x86-64 with a C compiler stages with the streaming copy: a build hook that failed
    quietly (the wheel is then pure Python and staging copies with memmove) fails here."""
    if not _can_build():
        pytest.skip("not Linux x86-64 with a C compiler")
    monkeypatch.delenv("TIERSAVE_STAGE_COPY", raising=False)
    assert memcopy.stream_available(), f"{memcopy.LIBRARY} is missing or does not load"
    copier = HostCopier(threads=1)
    try:
        assert copier.routine in ("stream-avx2", "stream-sse2")
    finally:
        copier.close()


def _cc() -> list[str]:
    return (os.environ.get("CC") or "cc").split()


def _built_copy(tmp_path: Path, monkeypatch, loop: str):
    """The installed streaming copy (``loop="default"``) or a second instance of the same library loaded with the
    SSE2 loop forced (its own copy of the file, so its own load-time choice)."""
    if loop == "default":
        monkeypatch.setenv("TIERSAVE_STAGE_COPY", "stream")
        return memcopy.large_copy()
    lib = tmp_path / "_streamcopy.so"
    shutil.copy(memcopy.LIBRARY, lib)
    shutil.copy(memcopy.LIBRARY.with_suffix(".c"), lib.with_suffix(".c"))
    monkeypatch.setenv("TIERSAVE_STREAM_LOOP", loop)
    loaded = memcopy._load(lib)
    assert loaded is not None
    copy, kind = loaded
    return copy, f"stream-{kind}"


@needs_stream
@pytest.mark.parametrize("loop", ["default", "sse2"])
def test_the_streaming_copy_copies_every_size_and_alignment_exactly(monkeypatch, tmp_path, loop):
    copy, name = _built_copy(tmp_path, monkeypatch, loop)
    assert name.startswith("stream-") and (loop == "default" or name == f"stream-{loop}")
    rng = np.random.default_rng(7)
    guard = 256
    sizes = [0, 1, 63, 4096, SMALL - 1, SMALL, SMALL + 1, SMALL + 127, SMALL + 128, (1 << 20) + 4095, (8 << 20) + 65]
    for n in sizes:
        src = rng.integers(0, 256, n + 2 * guard, dtype=np.uint8)
        for d_off in (0, 1, 17, 63, 64):
            for s_off in (0, 3, 32):
                dst = np.full(n + 2 * guard, 0xA5, dtype=np.uint8)
                copy(dst.ctypes.data + guard + d_off, src.ctypes.data + guard + s_off, n)
                where = f"n={n} dst+{d_off} src+{s_off}"
                assert np.array_equal(dst[guard + d_off : guard + d_off + n], src[guard + s_off : guard + s_off + n]), (
                    where
                )
                assert (dst[: guard + d_off] == 0xA5).all() and (dst[guard + d_off + n :] == 0xA5).all(), where


@needs_stream
@pytest.mark.parametrize("shift", [-4099, 4099], ids=["backward", "forward"])
def test_overlapping_ranges_are_copied_as_memmove_copies_them(monkeypatch, shift):
    monkeypatch.setenv("TIERSAVE_STAGE_COPY", "stream")
    copy, _ = memcopy.large_copy()
    n, at = 4 * SMALL, 8192  # the shifted range stays inside the buffer either way
    base = np.random.default_rng(3).integers(0, 256, n + 2 * at, dtype=np.uint8)
    expected = base.copy()
    ctypes.memmove(expected.ctypes.data + at + shift, expected.ctypes.data + at, n)
    copy(base.ctypes.data + at + shift, base.ctypes.data + at, n)
    assert np.array_equal(base, expected)


@pytest.mark.parametrize("routine", ["stream", "memmove"])
def test_the_host_copier_copies_exactly_with_either_routine(monkeypatch, routine):
    if routine == "stream" and not memcopy.stream_available():
        pytest.skip("the streaming copy was not built here")
    monkeypatch.setenv("TIERSAVE_STAGE_COPY", routine)
    src = torch.randint(0, 256, ((72 << 20) + 12345,), dtype=torch.uint8)  # over _STREAM_MIN, a ragged tail
    dst = torch.zeros((src.numel() + 64,), dtype=torch.uint8)
    copier = HostCopier(threads=2)
    try:
        assert copier.routine.startswith(routine)
        half = (src.numel() // 2) | 1  # odd: the second copy's destination is unaligned
        copier.copy_many(
            [(dst.data_ptr(), src.data_ptr(), half), (dst.data_ptr() + half, src.data_ptr() + half, src.numel() - half)]
        )
        assert torch.equal(dst[: src.numel()], src) and not dst[src.numel() :].any()
    finally:
        copier.close()


def test_only_copies_larger_than_the_cache_stream(monkeypatch):
    """Below ``_STREAM_MIN`` bytes in all a copy stays in the cache for the writers that read it back (memmove);
    from it on, every byte goes through the streaming routine."""
    streamed: list[int] = []

    def recording(dst, src, n):
        streamed.append(n)
        return ctypes.memmove(dst, src, n)

    monkeypatch.setattr(stage, "large_copy", lambda: (recording, "stream-recording"))
    src = torch.randint(0, 256, (stage._STREAM_MIN,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copier = HostCopier(threads=2)
    try:
        small = stage._STREAM_MIN // 2 - 1
        copier.copy_many(
            [(dst.data_ptr(), src.data_ptr(), small), (dst.data_ptr() + small, src.data_ptr() + small, small)]
        )
        copier.copy(dst.data_ptr(), src.data_ptr(), small)
        assert streamed == []
        copier.copy_many([(dst.data_ptr(), src.data_ptr(), src.numel())])
        assert sum(streamed) == src.numel()
        streamed.clear()
        copier.copy(dst.data_ptr(), src.data_ptr(), src.numel())
        assert sum(streamed) == src.numel()
    finally:
        copier.close()
    assert torch.equal(dst, src)


def test_a_bad_or_impossible_copy_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TIERSAVE_STAGE_COPY", "fast")
    with pytest.raises(ConfigError, match="TIERSAVE_STAGE_COPY='fast' is not one of auto, stream, memmove"):
        HostCopier(threads=1)
    monkeypatch.setattr(memcopy, "_loaded", [None])  # an install without the library
    monkeypatch.setenv("TIERSAVE_STAGE_COPY", "stream")
    with pytest.raises(ConfigError, match=r"streaming copy _streamcopy\.so was not built"):
        memcopy.large_copy()
    monkeypatch.setenv("TIERSAVE_STAGE_COPY", "auto")
    assert memcopy.large_copy() == (ctypes.memmove, "memmove")


def _compile(tmp_path: Path, source: str, define: str) -> Path:
    (tmp_path / "_streamcopy.c").write_text(source)
    lib = tmp_path / "_streamcopy.so"
    flags = ["-O2", "-fPIC", "-shared", f'-DTIERSAVE_STREAMCOPY_SOURCE="{define}"']
    subprocess.run([*_cc(), *flags, "-o", str(lib), str(tmp_path / "_streamcopy.c")], check=True, timeout=120)
    return lib


@pytest.mark.parametrize("mismatch", ["none", "abi", "source"])
def test_a_library_from_another_version_or_source_is_not_loaded(tmp_path, caplog, mismatch):
    """The ABI number and the SHA-256 of the source it was built from must match the loader and the
    ``_streamcopy.c`` beside it (a stale build in an editable install is refused)."""
    if not _can_build():
        pytest.skip("not Linux x86-64 with a C compiler")
    source = (ROOT / "src/tiersave/engine/_streamcopy.c").read_text()
    if mismatch == "abi":
        source = source.replace(
            "tiersave_stream_copy_abi(void) { return 1; }", "tiersave_stream_copy_abi(void) { return 0; }"
        )
    digest = hashlib.sha256(source.encode()).hexdigest()
    lib = _compile(tmp_path, source, "0" * 64 if mismatch == "source" else digest)
    with caplog.at_level("WARNING", logger="tiersave.engine.memcopy"):
        loaded = memcopy._load(lib)
    if mismatch == "none":
        assert loaded is not None and caplog.text == ""
    else:
        assert loaded is None
        why = "from another version of tiersave (ABI 0, not 1)" if mismatch == "abi" else "was built from another"
        assert why in caplog.text


def _project(tmp_path: Path) -> Path:
    """A copy of the files a build reads, without any built library."""
    project = tmp_path / "project"
    project.mkdir(parents=True)
    for name in ("pyproject.toml", "hatch_build.py", "README.md", ".gitignore"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return project


def _build_wheel(project: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(project.parent / "dist")],
        cwd=project,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_wheel_built_with_a_compiler_carries_the_streaming_copy(tmp_path):
    if not _can_build():
        pytest.skip("not Linux x86-64 with a C compiler")
    done = _build_wheel(_project(tmp_path), {"TIERSAVE_BUILD_NATIVE": "1"})
    assert done.returncode == 0, done.stderr
    assert "warning:" not in done.stderr  # the compiler's: the C stays warning-free at -Wall -Wextra
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert LIBRARY in zf.namelist() and LIBRARY.replace(".so", ".c") in zf.namelist()
        (tmp_path / "_streamcopy.so").write_bytes(zf.read(LIBRARY))
        (tmp_path / "_streamcopy.c").write_bytes(zf.read(LIBRARY.replace(".so", ".c")))
    assert memcopy._load(tmp_path / "_streamcopy.so") is not None  # its source hash matches the shipped source


@pytest.mark.parametrize("how", ["no compiler", "not built"])
def test_without_the_library_the_wheel_is_pure_python_says_why_and_no_stale_build_remains(tmp_path, how):
    project = _project(tmp_path)
    stale = project / "src" / LIBRARY
    stale.write_bytes(b"an earlier build")
    env = (
        {"CC": "/nonexistent/cc", "TIERSAVE_BUILD_NATIVE": "auto"}
        if how == "no compiler"
        else {"TIERSAVE_BUILD_NATIVE": "0"}
    )
    done = _build_wheel(project, env)
    assert done.returncode == 0, done.stderr
    assert not stale.exists()
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert LIBRARY not in zf.namelist()
    if how == "no compiler":
        if _can_build():  # elsewhere the build says the platform is the reason
            assert "no C compiler '/nonexistent/cc'" in done.stderr
        assert "staging will copy with memmove" in done.stderr
        (tmp_path / "dist" / wheel.name).unlink()
        required = _build_wheel(project, {"CC": "/nonexistent/cc", "TIERSAVE_BUILD_NATIVE": "1"})
        assert required.returncode != 0
