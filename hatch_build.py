"""Wheel build hook: compiles tiersave's one native routine, the streaming copy staging uses.

``src/tiersave/engine/_streamcopy.c`` becomes ``src/tiersave/engine/_streamcopy.so``, a plain shared library that
``tiersave.engine.memcopy`` loads with ctypes (no Python headers: one build serves every Python version). It is
built for Linux on x86-64 with the C compiler in ``CC`` (else ``cc``); elsewhere, or when the compiler is missing
or fails, the wheel is pure Python and staging copies with ``memmove`` (slower, equally correct), and the build
says so. ``TIERSAVE_BUILD_NATIVE``: ``auto`` (the default, as above), ``1`` (fail the build instead of going
without) or ``0`` (do not build it).
"""

from __future__ import annotations

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
FLAGS = ["-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror"]


class StreamCopyBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        mode = os.environ.get("TIERSAVE_BUILD_NATIVE", "auto")
        if mode not in ("auto", "0", "1"):
            raise ValueError(f"TIERSAVE_BUILD_NATIVE={mode!r} is not one of auto, 0, 1")
        if mode == "0":
            return
        try:
            self._compile()
        except RuntimeError as exc:
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
        out = os.path.join(self.root, LIBRARY)
        tmp = f"{out}.{os.getpid()}.tmp"
        cmd = [*cc, *FLAGS, "-o", tmp, os.path.join(self.root, SOURCE)]
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
