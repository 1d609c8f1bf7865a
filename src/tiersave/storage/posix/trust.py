"""Which directories tiersave agrees to keep checkpoints in: nobody else may be able to change them.

Scope: two checks made when a storage is opened, before any byte is read or written.

- :func:`check_private_dir`, the memory tier's base directory (``/dev/shm/tiersave-<uid>``): it must be a
  real directory (not a link), owned by this user and not writable by group or others, as ssh treats the
  files holding its keys. Anything else is refused: whoever else can write there could delete or replace
  checkpoints (a forged manifest carries its own checksums) or plant links.
- :func:`check_root`, a local checkpoint root a user points at: refused when it is writable by group or
  others *and* owned by another user (another user's directory in a shared place, such as ``/tmp`` itself
  or a world-writable directory someone else created). A directory of your own is yours to share; a
  deliberately shared team directory owned by a colleague can be allowed with
  ``TIERSAVE_ALLOW_SHARED_ROOT=1``.

Anti-scope: the links and special files inside a root (:mod:`tiersave.storage.posix.safepath`),
permissions of the files tiersave creates (the umask decides).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ...errors import ConfigError
from ...knobs import int_env

__all__ = ["ALLOW_SHARED_ROOT", "check_private_dir", "check_root", "owner_name"]

ALLOW_SHARED_ROOT = "TIERSAVE_ALLOW_SHARED_ROOT"


def owner_name(uid: int) -> str:
    """``uid 1001 (alice)``, or ``uid 1001`` where the name is unknown."""
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _writable_by(mode: int) -> str:
    who = [w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if mode & bit]
    return " and ".join(who)


def check_private_dir(path: Path, *, what: str, fix: str) -> None:
    """Refuse ``path`` unless it is a directory (not a link) owned by this user, not group/other-writable.

    Args:
        path: the directory.
        what: what it is, for the message (``"memory-tier directory"``).
        fix: what the user can do about it, appended to the message.

    Raises:
        ConfigError: naming the path, its owner and mode, and ``fix``.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"cannot inspect the {what} {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise ConfigError(f"the {what} {path} is {kind}; refusing to use it. {fix}")
    euid = os.geteuid()
    problems = []
    if st.st_uid != euid:
        problems.append(f"owned by {owner_name(st.st_uid)}, not by you ({owner_name(euid)})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"writable by {_writable_by(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})")
    if problems:
        raise ConfigError(
            f"the {what} {path} is {' and '.join(problems)}: another user could delete or replace checkpoints "
            f"there, or plant links; refusing to use it. {fix}"
        )


def check_root(path: Path) -> None:
    """Refuse a local root that is group- or other-writable and owned by another user.

    ``TIERSAVE_ALLOW_SHARED_ROOT=1`` accepts it (a team directory shared on purpose).

    Raises:
        ConfigError: naming the path, its owner and mode, and the way to accept it.
    """
    st = os.stat(path)
    if not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid == os.geteuid():
        return
    if int_env(ALLOW_SHARED_ROOT, 0, 0, 1):
        return
    raise ConfigError(
        f"checkpoint root {path} is owned by {owner_name(st.st_uid)} and writable by {_writable_by(st.st_mode)} "
        f"(mode {stat.S_IMODE(st.st_mode):04o}): another user could delete or replace its checkpoints. Use a "
        f"directory of your own, or set {ALLOW_SHARED_ROOT}=1 if this directory is shared on purpose with people "
        "you trust"
    )
