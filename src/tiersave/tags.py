"""Movable tags: a name (``serving``, ``best``) that training or a person points at a committed step and
moves later, stored next to the checkpoints so every process reading the root sees it.

Scope: the tag records under ``ROOT/tags/NAME.json`` (one small JSON object per name: ``{"step": N,
"manifest_sha256": ..., "time": ...}``), written with one atomic ``put`` (temporary file + rename on file
systems, a single PUT on object stores), read defensively (size cap, strict JSON, schema), checked against
the checkpoint they name (committed when tagged; still there, with the same manifest, when resolved).
Anti-scope: the tags a save writes into its manifest (immutable, format/manifest.py), retention (catalog.py
keeps every step a movable tag points to), following a tag (watch.py).

Torch-free, so ``tiersave tag`` and ``tiersave ls`` work on any machine.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import CheckpointNotFoundError, ConfigError, FormatError, ObjectNotFoundError, StorageError
from .format.jsonsafe import loads_strict
from .format.layout import MANIFEST_NAME, MAX_MANIFEST_BYTES, MAX_STEP, is_valid_tag, step_dirname
from .format.manifest import Manifest
from .storage.base import Storage

__all__ = ["MAX_TAG_BYTES", "TAGS_PREFIX", "MovableTag", "TagStore", "tag_step"]

TAGS_PREFIX = "tags"
MAX_TAG_BYTES = 4096
"""A tag record is about 120 bytes; anything larger is not one (read with this cap, never in full)."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class MovableTag:
    """A movable tag as stored.

    Attributes:
        name: the tag's name.
        step: the step it points to.
        manifest_sha256: SHA-256 of that checkpoint's manifest bytes when it was tagged (a checkpoint deleted
            and saved again under the same step is not the one that was tagged).
        time: when it was set (seconds since the epoch).
    """

    name: str
    step: int
    manifest_sha256: str
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "manifest_sha256": self.manifest_sha256, "time": self.time}


def check_name(name: object) -> str:
    """``name`` if it is a valid tag name (letters, digits, ``._-``, at most 64, not starting with a symbol)."""
    if not isinstance(name, str) or not is_valid_tag(name):
        raise ConfigError(
            f"{name!r} is not a valid tag name: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


class TagStore:
    """The movable tags of one storage root. Every method may be called from any thread and any process."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def _key(self, name: str) -> str:
        return f"{TAGS_PREFIX}/{check_name(name)}.json"

    def _where(self, name: str) -> str:
        return f"{self.storage.uri.rstrip('/')}/{self._key(name)}"

    # -- reading ----------------------------------------------------------------------------------

    def get(self, name: str) -> MovableTag | None:
        """The tag ``name``, or None when there is no such movable tag.

        Raises:
            FormatError: the tag file is not a tag record (too large, not JSON, wrong fields, a link).
        """
        key = self._key(name)
        try:
            data = self.storage.get(key, max_bytes=MAX_TAG_BYTES)
        except ObjectNotFoundError:
            return None
        except FormatError as exc:
            raise FormatError(f"tag {name!r} at {self._where(name)}: {exc}", path=self._where(name)) from None
        except StorageError as exc:  # a link or a non-regular file where a tag record should be
            raise FormatError(f"tag {name!r} at {self._where(name)} cannot be read as a tag: {exc}") from None
        return _parse(name, data, self._where(name))

    def names(self) -> list[str]:
        """The names of the tags stored under ``tags/``, sorted (files that are not ``NAME.json`` are ignored:
        the temporary files of a write in progress)."""
        out = []
        try:
            keys = [obj.key for obj in self.storage.list(TAGS_PREFIX)]
        except ObjectNotFoundError:
            return []
        for key in keys:
            head, _, leaf = key.partition("/")
            if head == TAGS_PREFIX and "/" not in leaf and leaf.endswith(".json") and is_valid_tag(leaf[:-5]):
                out.append(leaf[:-5])
        return sorted(out)

    def all(self) -> tuple[dict[str, MovableTag], dict[str, FormatError]]:
        """Every movable tag of the root, and the tag files that cannot be read (name -> error)."""
        tags: dict[str, MovableTag] = {}
        bad: dict[str, FormatError] = {}
        for name in self.names():
            try:
                tag = self.get(name)
            except FormatError as exc:
                bad[name] = exc
                continue
            if tag is not None:  # untagged between the listing and the read
                tags[name] = tag
        return tags, bad

    def by_step(self) -> dict[int, tuple[str, ...]]:
        """Step -> the names of the readable movable tags pointing at it."""
        out: dict[int, list[str]] = {}
        for name, tag in self.all()[0].items():
            out.setdefault(tag.step, []).append(name)
        return {step: tuple(names) for step, names in out.items()}

    def resolve(self, name: str) -> MovableTag | None:
        """The tag ``name`` checked against its checkpoint; None when there is no such movable tag.

        Raises:
            CheckpointNotFoundError: the step it points to is no longer committed, or was saved again since.
            FormatError: the tag file is not a tag record.
        """
        tag = self.get(name)
        if tag is None:
            return None
        try:
            digest = self._manifest_sha256(tag.step)
        except ObjectNotFoundError:
            raise CheckpointNotFoundError(
                f"tag {name!r} in {self.storage.uri} points at step {tag.step}, which is no longer committed "
                f"(deleted after it was tagged at {_when(tag.time)}); move it with ckpt.tag(STEP, {name!r}) or "
                f"`tiersave tag ROOT STEP {name}`"
            ) from None
        if digest != tag.manifest_sha256:
            raise CheckpointNotFoundError(
                f"tag {name!r} in {self.storage.uri} points at step {tag.step}, but that step was deleted and saved "
                f"again after it was tagged at {_when(tag.time)} (manifest sha256 {digest[:16]}..., tagged "
                f"{tag.manifest_sha256[:16]}...); move the tag to confirm the new checkpoint"
            )
        return tag

    # -- writing ----------------------------------------------------------------------------------

    def set(self, name: str, step: int) -> MovableTag:
        """Point ``name`` at the committed checkpoint of ``step`` (creating or moving the tag).

        Raises:
            ConfigError: a bad name or step.
            CheckpointNotFoundError: ``step`` is not committed in this root.
            FormatError: its manifest is not valid (a damaged checkpoint is never tagged).
        """
        key = self._key(name)
        _check_step(step)
        digest = self._checked_sha256(step, name)
        tag = MovableTag(name, step, digest, time.time())
        doc = {"step": step, "manifest_sha256": digest, "time": tag.time}
        self.storage.put(key, _dumps(doc), mode="overwrite")
        try:  # retention of another process may have deleted the step meanwhile: never leave a dangling tag
            self._manifest_sha256(step)
        except ObjectNotFoundError:
            self.storage.delete(key)
            raise CheckpointNotFoundError(
                f"cannot tag step {step} as {name!r}: it was deleted from {self.storage.uri} while being tagged"
            ) from None
        return tag

    def delete(self, name: str) -> bool:
        """Remove the tag ``name``; returns whether it existed."""
        key = self._key(name)
        existed = self.storage.exists(key)
        self.storage.delete(key)
        return existed

    def _manifest_sha256(self, step: int) -> str:
        data = self.storage.get(f"{step_dirname(step)}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES)
        return hashlib.sha256(data).hexdigest()

    def _checked_sha256(self, step: int, name: str) -> str:
        key = f"{step_dirname(step)}/{MANIFEST_NAME}"
        try:
            data = self.storage.get(key, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            raise CheckpointNotFoundError(
                f"cannot tag step {step} as {name!r}: no committed checkpoint of step {step} in {self.storage.uri}"
            ) from None
        Manifest.parse(data, path=f"{self.storage.uri.rstrip('/')}/{key}", expect_step=step)
        return hashlib.sha256(data).hexdigest()


class _Pinning(Protocol):
    """What :func:`tag_step` needs of a catalog: its tags, and pins that its retention respects."""

    @property
    def tags(self) -> TagStore: ...

    def pin(self, step: int | None = None) -> Manifest | None: ...

    def unpin(self, step: int) -> None: ...


def tag_step(catalog: _Pinning, step: int, name: str) -> MovableTag:
    """``Checkpointer.tag``: point ``name`` at ``step`` while the step is pinned, so that this process's
    retention cannot delete it between the check and the write (another process's retention is caught by
    :meth:`TagStore.set`'s check after the write)."""
    check_name(name)
    _check_step(step)
    pinned = catalog.pin(step) is not None
    try:
        return catalog.tags.set(name, step)
    finally:
        if pinned:
            catalog.unpin(step)


def _check_step(step: object) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step must be an integer in [0, 2**63), got {step!r}")


def _dumps(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, allow_nan=False, sort_keys=True) + "\n").encode()


def _parse(name: str, data: bytes, where: str) -> MovableTag:
    """A tag record from its bytes; FormatError naming ``where`` for anything else."""
    doc = loads_strict(data, what=f"tag {name!r} at {where}", max_bytes=MAX_TAG_BYTES)
    if not isinstance(doc, dict):
        raise FormatError(f"tag {name!r} at {where}: expected a JSON object, got {type(doc).__name__}", path=where)
    step, digest, when = doc.get("step"), doc.get("manifest_sha256"), doc.get("time")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise FormatError(f"tag {name!r} at {where}: 'step' must be an integer in [0, 2**63), got {step!r}", path=where)
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise FormatError(f"tag {name!r} at {where}: 'manifest_sha256' must be 64 hex digits", path=where)
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not when >= 0:
        raise FormatError(f"tag {name!r} at {where}: 'time' must be a non-negative number", path=where)
    return MovableTag(name, step, digest, float(when))


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
