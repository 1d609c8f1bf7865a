"""What travels between ranks: JSON documents as uint8 tensors, a fixed header, and failure reports.

Scope: turning JSON documents into bytes and back (never pickle), the 7-word header that frames every
message, and the failure report rank 0 sends when an exchange fails, including how every rank rebuilds the
same :class:`~tiersave.errors.DistributedCheckpointError` from it.

Anti-scope: sending or receiving anything (``group.py``), deciding a commit (``vote.py``).

A message is a header tensor (``HEADER_WORDS`` int64) followed, when ``nbytes > 0``, by a uint8 payload
tensor of exactly ``nbytes`` bytes: the receiver learns the length from the header before it posts the
receive for the payload (gloo needs matching sizes). The header carries a magic number, the call's sequence
number and operation code (so ranks that call in different orders are detected, not mismatched), the step,
the payload's CRC-32 and a check word over all of them (so a header read while it is still arriving is never
taken for a complete one).
"""

from __future__ import annotations

import builtins
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from .. import errors as _errors
from ..errors import DistributedCheckpointError, TiersaveError
from ..format.jsonsafe import paused_gc

__all__ = [
    "HEADER_WORDS",
    "MAGIC",
    "Decline",
    "Header",
    "Json",
    "RemoteRankError",
    "decode_json",
    "encode_json",
    "error_from_report",
    "failure_error",
    "failure_report",
    "rank_list",
    "report_error",
    "show",
]

Json: TypeAlias = bool | int | float | str | list["Json"] | dict[str, "Json"] | None
"""A JSON document as :func:`json.loads` returns it (what the collectives carry)."""

MAGIC = 0x7453_6176_6544_6931  # "tSaveDi1": not a plausible value for any other message on the group
HEADER_WORDS = 7
_MAX_MESSAGE_TEXT = 4000  # error texts are clipped: a failure report must stay small at any world size


def encode_json(doc: Json) -> bytes:
    """``doc`` as compact UTF-8 JSON.

    Raises:
        TypeError: ``doc`` holds something JSON cannot represent (an object, bytes, a tensor).
        ValueError: ``doc`` holds a NaN or an infinity (not JSON; it would not round-trip), or a cycle.
    """
    with paused_gc():  # a rank's part of a save lists every tensor: no collection in the middle of it
        return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def decode_json(data: bytes) -> Json:
    """The document :func:`encode_json` made ``data`` from."""
    with paused_gc():  # millions of acyclic objects from a many-rank vote: collections would rescan them all
        doc: Json = json.loads(data.decode("utf-8")) if data else None
    return doc


@dataclass(frozen=True)
class Header:
    """The fixed-size frame in front of every message.

    Attributes:
        seq: the sender's call number on the group (1 for the first exchange after setup).
        op: the operation code of the call (see ``group.OPS``).
        step: the step the caller named, or -1 for none.
        nbytes: the length of the payload that follows (0: no payload message).
        crc: CRC-32 of the payload bytes.
    """

    seq: int
    op: int
    step: int
    nbytes: int
    crc: int

    def words(self) -> list[int]:
        """The header as ``HEADER_WORDS`` signed 64-bit integers, check word last."""
        body = [MAGIC, self.seq, self.op, self.step, self.nbytes, self.crc]
        check = 0
        for word in body:
            check ^= word
        return [*body, check]

    @classmethod
    def for_payload(cls, *, seq: int, op: int, step: int | None, payload: bytes) -> Header:
        """The header announcing ``payload``."""
        return cls(seq=seq, op=op, step=-1 if step is None else step, nbytes=len(payload), crc=zlib.crc32(payload))

    @classmethod
    def parse(cls, words: list[int]) -> Header | None:
        """The header in ``words``, or None when they do not hold a complete, valid one."""
        if len(words) != HEADER_WORDS or words[0] != MAGIC:
            return None
        check = 0
        for word in words[:-1]:
            check ^= word
        if check != words[-1] or words[4] < 0:
            return None
        return cls(seq=words[1], op=words[2], step=words[3], nbytes=words[4], crc=words[5])


class RemoteRankError(TiersaveError):
    """Stands for an exception raised on another rank whose type this rank does not rebuild.

    Only carried in :attr:`DistributedCheckpointError.failures`, never raised.

    Attributes:
        rank: the rank the error happened on.
        type_name: the name of the original exception type, e.g. ``"CalledProcessError"``.
    """

    def __init__(self, message: str, *, rank: int, type_name: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.rank = rank
        self.type_name = type_name


def _rebuildable() -> dict[str, type[BaseException]]:
    # Only tiersave's own errors and a few builtins whose constructor takes a message are rebuilt, by name,
    # from a fixed table: a report can never make a rank import or instantiate anything else.
    table: dict[str, type[BaseException]] = {}
    for name in _errors.__all__:
        cls = getattr(_errors, name)
        if isinstance(cls, type) and issubclass(cls, TiersaveError) and cls is not DistributedCheckpointError:
            table[name] = cls
    for cls in (
        builtins.OSError,
        builtins.TimeoutError,
        builtins.ConnectionError,
        builtins.RuntimeError,
        builtins.ValueError,
        builtins.TypeError,
        builtins.MemoryError,
        builtins.AssertionError,
        builtins.NotImplementedError,
    ):
        table[cls.__name__] = cls
    return table


_REBUILDABLE = _rebuildable()


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE_TEXT else text[: _MAX_MESSAGE_TEXT - 15] + " ...[clipped]"


def report_error(exc: BaseException) -> dict[str, Json]:
    """A JSON report of ``exc``: its type name and its message (clipped to a few KB)."""
    return {"type": type(exc).__name__, "message": _clip(str(exc))}


def error_from_report(rank: int, report: Mapping[str, Json]) -> BaseException:
    """The exception a report stands for: the original type for tiersave errors and common builtins, else a
    :class:`RemoteRankError` carrying the type's name. Never imports anything named by the report."""
    type_name = str(report.get("type", "Exception"))
    message = str(report.get("message", ""))
    cls = _REBUILDABLE.get(type_name)
    if cls is not None:
        try:
            return cls(message)
        except Exception:  # a constructor with required arguments: fall through to the generic carrier
            pass
    return RemoteRankError(message, rank=rank, type_name=type_name)


def rank_list(ranks: Sequence[int]) -> str:
    """``"rank 3"`` or ``"ranks 1, 4"``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def show(value: Json) -> str:
    """``repr(value)``, clipped to about 200 characters for error messages."""
    text = repr(value)
    return text if len(text) <= 200 else text[:190] + " ...[clipped]"


def failure_report(
    *,
    op: str,
    phase: str,
    step: int | None,
    summary: str,
    failures: Mapping[int, Mapping[str, Json]],
    poison: bool,
) -> dict[str, Json]:
    """The report rank 0 sends every rank when an exchange fails; every rank raises :func:`failure_error` of it.

    Args:
        op: the call that failed, e.g. ``"vote"``.
        phase: where it failed: ``"collect"`` (rank 0 gathering), ``"decide"`` (rank 0 judging what it
            gathered: votes, agreement), ``"commit"`` (rank 0's commit callback), ``"reply"`` (waiting for
            rank 0's answer).
        step: the step concerned, if any.
        summary: one sentence naming the failing ranks and what happened.
        failures: per failing rank, a :func:`report_error`-style report.
        poison: whether the group can no longer be used (communication failed, not just a rank's "no").
    """
    return {
        "op": op,
        "phase": phase,
        "step": step,
        "summary": summary,
        "failures": [{"rank": rank, **dict(rep)} for rank, rep in sorted(failures.items())],
        "poison": poison,
    }


class Decline(Exception):
    """Raised by rank 0's decision function to fail an exchange cleanly with ``report`` (internal)."""

    def __init__(self, report: dict[str, Json]) -> None:
        super().__init__(str(report.get("summary")))
        self.report = report


def failure_error(report: Mapping[str, Json]) -> DistributedCheckpointError:
    """The :class:`DistributedCheckpointError` for a failure report (the same text on every rank)."""
    step = report.get("step")
    where = f"step {step}" if step is not None else "no step"
    message = (
        f"tiersave coordination failed ({where}, {report.get('op')}/{report.get('phase')}): {report.get('summary')}"
    )
    if report.get("poison"):
        message += "; the coordination group is unusable from now on (restart the job)"
    failures: dict[int, BaseException] = {}
    raw = report.get("failures")
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, dict) and isinstance(item.get("rank"), int):
            rank = item["rank"]
            assert isinstance(rank, int)
            failures[rank] = error_from_report(rank, item)
    return DistributedCheckpointError(message, failures)
