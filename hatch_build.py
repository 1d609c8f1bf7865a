"""Wheel build hook: compiles tiersave's one native routine, the streaming copy staging uses.

``src/tiersave/engine/_streamcopy.c`` becomes ``src/tiersave/engine/_streamcopy.so``, a plain shared library that
``tiersave.engine.memcopy`` loads with ctypes (no Python headers: one build serves every Python version). It is
built for Linux on x86-64 with the C compiler in ``CC`` (else ``cc``) and the flags in ``CFLAGS``; elsewhere, or
when the compiler is missing or fails, the wheel is pure Python and staging copies with ``memmove`` (slower,
equally correct), and the build says so (pip shows it with ``-v``). ``TIERSAVE_BUILD_NATIVE``: ``auto`` (the
default, as above), ``1`` (fail the build instead of going without) or ``0`` (do not build it). A library left
in the source tree by an earlier build is removed whenever none is built, and the library carries the SHA-256
of its source, so an editable install never runs a stale build.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "src/tiersave/engine/_streamcopy.c"
LIBRARY = "src/tiersave/engine/_streamcopy.so"
FLAGS = ["-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra"]


class StreamCopyBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        mode = os.environ.get("TIERSAVE_BUILD_NATIVE", "auto")
        if mode not in ("auto", "0", "1"):
            raise ValueError(f"TIERSAVE_BUILD_NATIVE={mode!r} is not one of auto, 0, 1")
        if mode == "0":
            self._remove_stale()
            return
        try:
            self._compile()
        except RuntimeError as exc:
            self._remove_stale()
            if mode == "1":
                raise
            sys.stderr.write(f"tiersave: {exc}; staging will copy with memmove (slower, equally correct)\n")
            return
        build_data["pure_python"] = False
        # loaded with ctypes, not imported: any Python 3 on this platform can use it
        build_data["tag"] = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["artifacts"].append(LIBRARY)

    def _compile(self) -> None:
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError(f"no streaming copy for {sys.platform} on {platform.machine()}")
        cc = shlex.split(os.environ.get("CC") or "cc")
        if shutil.which(cc[0]) is None:
            raise RuntimeError(f"no C compiler {cc[0]!r} to build the streaming copy (set CC)")
        out, source = os.path.join(self.root, LIBRARY), os.path.join(self.root, SOURCE)
        tmp = f"{out}.{os.getpid()}.tmp"
        with open(source, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        cflags = shlex.split(os.environ.get("CFLAGS", ""))
        cmd = [*cc, *FLAGS, *cflags, f'-DTIERSAVE_STREAMCOPY_SOURCE="{digest}"', "-o", tmp, source]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{shlex.join(cmd)} failed: {exc}") from None
        if done.returncode != 0:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise RuntimeError(f"{shlex.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, out)  # a process with the old library mapped keeps it; the next one loads the new

    def _remove_stale(self) -> None:
        try:
            os.unlink(os.path.join(self.root, LIBRARY))
        except FileNotFoundError:
            pass
