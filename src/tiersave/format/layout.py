"""Names and alignment rules of a checkpoint root (docs/format.md sections 2 and 3)."""

from __future__ import annotations

import re
import secrets

ALIGN = 4096
"""Tensor offsets and shard lengths are multiples of this (the common logical block size for O_DIRECT)."""

MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
MAX_CHUNK_BYTES = 64 << 20
DEFAULT_CHUNK_BYTES = 64 << 20
MAX_STEP = (1 << 63) - 1

_STEP_RE = re.compile(r"^step-([0-9]{10,20})$")
_TMP_RE = re.compile(r"^step-([0-9]{10,20})\.tmp-[A-Za-z0-9_-]{1,64}$")
_TRASH_RE = re.compile(r"^step-([0-9]{10,20})\.trash-[A-Za-z0-9_-]{1,64}$")
_SAFE_COMPONENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_SAFE_FILE_RE = re.compile(rf"^{_SAFE_COMPONENT}(/{_SAFE_COMPONENT})?$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def align_up(n: int, align: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``align``."""
    return -(-n // align) * align


def step_dirname(step: int) -> str:
    """The directory (or key prefix) name of a committed checkpoint: ``step-0000000100``."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in [0, 2**63), got {step}")
    return f"step-{step:010d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a committed checkpoint's directory name, or None for any other name."""
    m = _STEP_RE.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP else None


def new_token() -> str:
    """A random token for temporary names, unique across processes and hosts."""
    return secrets.token_hex(8)


def tmp_dirname(step: int, token: str) -> str:
    return f"{step_dirname(step)}.tmp-{token}"


def trash_dirname(step: int, token: str) -> str:
    return f"{step_dirname(step)}.trash-{token}"


def is_leftover(name: str) -> bool:
    """True for a temporary or trash directory left by an interrupted save or delete."""
    return bool(_TMP_RE.match(name) or _TRASH_RE.match(name))


def shard_filename(rank: int, index: int) -> str:
    """The file name writers of this version give a shard: ``shard-00003-000.bin``."""
    return f"shard-{rank:05d}-{index:03d}.bin"


def is_safe_file(name: str) -> bool:
    """True when ``name`` is an allowed shard path: at most two safe components, no ``..``."""
    if not _SAFE_FILE_RE.match(name):
        return False
    return all(part not in (".", "..") for part in name.split("/"))


def is_valid_tag(tag: str) -> bool:
    return bool(_TAG_RE.match(tag))
