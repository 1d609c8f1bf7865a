"""The exchange: one gather of JSON documents to rank 0 and one reply from it, with deadlines and named failures.

Scope: the message sequence of one exchange (see the ``tiersave.dist.group`` module docstring for the
protocol, deadlines and failure semantics), sequence checking, and poisoning after a communication failure.

Anti-scope: what the documents mean (``group.py`` and ``vote.py`` supply rank 0's decision function).

Why point-to-point messages and not gloo's ``gather``/``broadcast``: a collective that times out says
neither *which* rank was missing nor lets rank 0 tell the others, and on gloo a ``wait(timeout)`` that
expires closes every connection of the group on that rank (and ``is_completed()`` of a point-to-point
receive stays false until someone waits on it). So rank 0 posts one header receive per peer and watches the
header buffers (gloo receives into them in place; a check word tells a complete header from one still
arriving), waits only on receives whose data has arrived, and, at its deadline, knows exactly which ranks
sent nothing while its connections to all the others are intact, so every reachable rank learns the names.
Followers wait for the reply with ``work.wait(timeout)``; if it expires they raise naming rank 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, DistributedCheckpointError
from .wire import (
    HEADER_WORDS,
    MAGIC,
    Decline,
    Header,
    Json,
    decode_json,
    encode_json,
    failure_error,
    failure_report,
    rank_list,
    report_error,
)

__all__ = ["OPS", "Channel", "Reply", "seconds"]

OPS = {"setup": 1, "gather": 2, "broadcast": 3, "all_gather": 4, "agree": 5, "vote": 6, "nonce": 7}
_OP_NAMES = {code: name for name, code in OPS.items()}
_TAG_UP_HEADER, _TAG_UP_PAYLOAD, _TAG_DOWN_HEADER, _TAG_DOWN_PAYLOAD = 7301, 7302, 7303, 7304
_MAX_POLL_PAUSE_S = 0.01

Reply = Callable[[list[Json]], Json]
"""Rank 0's decision: the documents by rank -> the reply every rank returns (raise ``Decline`` to fail)."""


def seconds(value: float) -> timedelta:
    """``value`` seconds as a timedelta for ``Work.wait``, never zero (which would mean "no timeout")."""
    return timedelta(seconds=max(value, 0.001))


def _comm_report(exc: BaseException, *, what: str) -> dict[str, Json]:
    text = f"{what}: {exc}"
    return report_error(TimeoutError(text) if "timed out" in str(exc).lower() else ConnectionError(text))


class Channel:
    """Runs exchanges over one process group; shared by all the calls of a :class:`CoordinationGroup`.

    Args:
        process_group: a gloo-capable group this rank belongs to.
        timeout_s: rank 0's deadline for gathering; followers add a reply allowance to it.
        max_message_bytes: the largest document accepted from one rank.
    """

    def __init__(self, process_group: Any, *, timeout_s: float, max_message_bytes: int) -> None:
        self._pg = process_group
        self._rank = dist.get_rank(process_group)
        self._world = dist.get_world_size(process_group)
        self._global = [dist.get_global_rank(process_group, r) for r in range(self._world)]
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._seq = 0
        self.poison: DistributedCheckpointError | None = None
        self._poison_report: dict[str, Json] | None = None
        self._notified = False
        self._informed: set[int] = set()  # the ranks that received a poisoning outcome from rank 0 (_lead)
        # Where the last exchange spent its time on this rank (rank 0: gather / decide / reply; the others:
        # send / wait), for the save's statistics: what a many-rank commit costs and who waits for whom.
        self.last_timing: dict[str, float] = {}
        # Tensors and works of exchanges that failed mid-flight: gloo may still write into (or read from)
        # them, so they must outlive the exchange; a poisoned channel holds at most one exchange's worth.
        self._graveyard: list[object] = []

    def exchange(
        self,
        op: str,
        step: int | None,
        doc: Json,
        reply: Reply,
        *,
        error: BaseException | None = None,
        reply_allowance_s: float | None = None,
        fail_phase: str = "decide",
    ) -> Json:
        if self._owner == threading.get_ident():
            raise ConfigError(f"tiersave coordination: {op} called from inside another call's callback")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                self._seq += 1
                self.last_timing = {}
                if self.poison is not None:
                    raise self._refuse(op, step) from self.poison
                entered = time.monotonic()
                envelope: Json = {"ok": False, "error": report_error(error)} if error else {"ok": True, "doc": doc}
                try:
                    payload = encode_json(envelope)
                except (TypeError, ValueError) as exc:
                    bad = ConfigError(f"rank {self._rank}'s {op} document is not JSON: {exc}")
                    payload = encode_json({"ok": False, "error": report_error(bad)})
                header = Header.for_payload(seq=self._seq, op=OPS[op], step=step, payload=payload)
                if self._rank == 0:
                    return self._lead(op, step, header, payload, reply, entered, fail_phase)
                allowance = self.timeout_s if reply_allowance_s is None else reply_allowance_s
                return self._follow(op, step, header, payload, entered, self.timeout_s + allowance)
            finally:
                self._owner = None

    def _poison_by(self, report: dict[str, Json], held: object) -> DistributedCheckpointError:
        """Mark the channel unusable because of ``report``; keep ``held`` (tensors, works) alive for gloo."""
        self._poison_report = report
        self.poison = failure_error(report)
        self._graveyard.append(held)
        return failure_error(report)

    def _refuse(self, op: str, step: int | None) -> DistributedCheckpointError:
        """The error of a call on a poisoned channel. Rank 0 also sends it, once, to every rank it can reach:
        a rank that missed the failure (e.g. one that got the last outcome while another rank did not) then
        fails at once instead of waiting for a reply that would never come."""
        assert self.poison is not None
        assert self._poison_report is not None
        first = str(self.poison).splitlines()[0]
        raw = self._poison_report.get("failures")
        failures: dict[int, dict[str, Json]] = {}
        for item in raw if isinstance(raw, list) else []:
            if isinstance(item, dict) and isinstance(item.get("rank"), int):
                rank = item["rank"]
                assert isinstance(rank, int)
                failures[rank] = item
        report = failure_report(
            op=op,
            phase="refused",
            step=step,
            summary=f"an earlier exchange failed and a sequence of collectives cannot be resumed safely ({first})",
            failures=failures,
            poison=True,
        )
        if self._rank == 0 and not self._notified:
            self._notified = True
            self._notify(op, step, report, failed=set(failures) | self._informed)
        return failure_error(report)

    def _notify(self, op: str, step: int | None, report: dict[str, Json], *, failed: set[int]) -> None:
        """Rank 0: send the failure ``report`` as this call's outcome to every other rank, and wait (at most
        ``timeout_s``) until the ranks it does not name have it.

        The wait is what makes the others name the failing rank: the ranks that did not see the failure are
        waiting in this call for rank 0's reply, and a rank 0 that returned at once and went on (raised to a
        caller that tears the job down, exits) closed its connections under the notice, so they named rank 0.
        The failed ranks, and those that already received a failed outcome, are sent to but never waited on:
        they are gone, or refuse their next call without receiving."""
        payload = encode_json({"ok": False, "failure": report})
        header = Header.for_payload(seq=self._seq, op=OPS[op], step=step, payload=payload)
        out = [torch.tensor(header.words()), _byte_tensor(payload)]
        sends: dict[int, list[Any]] = {}
        for r in range(1, self._world):
            try:
                sends[r] = self._send(out, r, (_TAG_DOWN_HEADER, _TAG_DOWN_PAYLOAD))
            except Exception:
                pass  # that rank is gone: nobody is waiting there
        self._graveyard.append([out, sends])  # gloo may still read them, whatever happens below
        deadline = time.monotonic() + self.timeout_s
        for r, works in sends.items():
            if r in failed:
                continue
            try:
                for work in works:
                    work.wait(seconds(deadline - time.monotonic()))
            except Exception:
                continue  # that rank left too, or never calls again (a wait that expires closes every connection)

    def _irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        work = dist.irecv(tensor, src=self._global[peer], group=self._pg, tag=tag)
        if work is None:  # only when this rank is not in the group, which the constructor rules out
            raise ConnectionError(f"receiving from rank {peer}: this rank is not in the group")
        return work

    def _send(self, tensors: list[torch.Tensor], peer: int, tags: tuple[int, int]) -> list[Any]:
        works = []
        for tensor, tag in zip(tensors, tags):
            if tensor.numel():
                work = dist.isend(tensor, dst=self._global[peer], group=self._pg, tag=tag)
                if work is None:
                    raise ConnectionError(f"sending to rank {peer}: this rank is not in the group")
                works.append(work)
        return works

    def _check_header(self, header: Header | None, expect: Header, sender: int) -> str | None:
        if header is None:
            return f"rank {sender} sent a malformed header"
        if header.seq != expect.seq or header.op != expect.op:
            theirs = _OP_NAMES.get(header.op, f"op {header.op}")
            return (
                f"rank {sender} is at call #{header.seq} ({theirs}) while rank {self._rank} is at call "
                f"#{expect.seq} ({_OP_NAMES.get(expect.op)}): ranks made different calls"
            )
        if header.nbytes > self.max_message_bytes:
            return f"rank {sender} announced {header.nbytes} bytes, over max_message_bytes={self.max_message_bytes}"
        return None

    def _lead(
        self,
        op: str,
        step: int | None,
        own: Header,
        own_payload: bytes,
        reply: Reply,
        entered: float,
        fail_phase: str,
    ) -> Json:
        """Rank 0: gather, decide, reply."""
        peers = range(1, self._world)
        docs: list[Json] = [None] * self._world
        envelopes: dict[int, Json] = {0: decode_json(own_payload)}
        lost: dict[int, dict[str, Json]] = {}  # communication failures: poison
        skewed: set[int] = set()  # ranks whose header belongs to another call
        held: list[object] = []
        headers = torch.zeros((self._world, HEADER_WORDS), dtype=torch.int64)
        header_works: dict[int, Any] = {}
        for r in peers:
            try:
                header_works[r] = self._irecv(headers[r], r, _TAG_UP_HEADER)
            except Exception as exc:  # gloo already knows the connection is gone
                lost[r] = _comm_report(exc, what=f"rank {r} is unreachable")
        held += [headers, header_works]
        payload_works: dict[int, tuple[Any, torch.Tensor, Header]] = {}
        pending = set(header_works)
        deadline = entered + self.timeout_s
        pause = 0.0005
        while pending:
            for r in _arrived(headers, pending):
                pending.discard(r)
                try:
                    header_works[r].wait(seconds(self.timeout_s))  # the bytes are in: returns at once
                    header = Header.parse(headers[r].tolist())
                    problem = self._check_header(header, own, r)
                    if problem is not None or header is None:
                        lost[r] = report_error(ConnectionError(problem))
                        skewed.add(r)
                        continue
                    buf = torch.empty(header.nbytes, dtype=torch.uint8)
                    work = self._irecv(buf, r, _TAG_UP_PAYLOAD) if header.nbytes else None
                    payload_works[r] = (work, buf, header)
                except Exception as exc:
                    lost[r] = _comm_report(exc, what=f"receiving rank {r}'s {op} header failed")
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_PAUSE_S)
        for r in sorted(pending):
            lost[r] = report_error(
                TimeoutError(f"rank {r} sent nothing within {self.timeout_s:g} s (hung, dead, or not calling {op})")
            )
        held.append(payload_works)
        for r, (work, buf, header) in sorted(payload_works.items()):
            try:
                if work is not None:
                    work.wait(seconds(self.timeout_s))
                data = buf.numpy().tobytes()
                if Header.for_payload(seq=0, op=0, step=None, payload=data).crc != header.crc:
                    raise ConnectionError(f"rank {r}'s {op} document arrived corrupted (CRC mismatch)")
                envelopes[r] = decode_json(data)
            except Exception as exc:
                lost[r] = _comm_report(exc, what=f"receiving rank {r}'s {op} document failed")

        gathered = time.monotonic()
        report = _judge(op, step, envelopes, docs, lost, skewed, reply, fail_phase, self.timeout_s)
        decided = time.monotonic()
        down: Json = {"ok": True, "doc": report[1]} if report[0] is None else {"ok": False, "failure": report[0]}
        try:
            out_payload = encode_json(down)
        except (TypeError, ValueError) as exc:
            bad = ConfigError(f"rank 0's {op} {fail_phase} returned a value that is not JSON: {exc}")
            not_json = failure_report(
                op=op,
                phase=fail_phase,
                step=step,
                summary=f"rank 0's {fail_phase} returned a value that is not JSON",
                failures={0: report_error(bad)},
                poison=False,
            )
            report = (not_json, None)
            out_payload = encode_json({"ok": False, "failure": not_json})
        out = [
            torch.tensor(Header.for_payload(seq=own.seq, op=own.op, step=step, payload=out_payload).words()),
            _byte_tensor(out_payload),
        ]
        held.append(out)
        undelivered: dict[int, dict[str, Json]] = {}
        sends: dict[int, list[Any]] = {}
        # Every send is posted before any is waited on, so one stuck rank delays nobody's outcome.
        for r in peers:
            try:
                sends[r] = self._send(out, r, (_TAG_DOWN_HEADER, _TAG_DOWN_PAYLOAD))
            except Exception as exc:
                if r not in lost:
                    undelivered[r] = _comm_report(exc, what=f"sending the {op} outcome to rank {r} failed")
        held.append(sends)
        for r, works in sends.items():
            if r in lost:
                continue  # best effort: a late rank may still read it; never wait on a rank known to be gone
            try:
                for work in works:
                    work.wait(seconds(self.timeout_s))
            except Exception as exc:
                undelivered[r] = _comm_report(exc, what=f"sending the {op} outcome to rank {r} failed")
        self.last_timing = {
            "gather_s": gathered - entered,
            "decide_s": decided - gathered,
            "reply_s": time.monotonic() - decided,
            "bytes_in": float(len(own_payload) + sum(h.nbytes for _, _, h in payload_works.values())),
        }
        failure = report[0]
        if failure is not None and failure.get("poison"):
            self._poison_by(failure, held)
            # these ranks have the failure as this call's outcome: they refuse their next call without posting
            # a receive, so rank 0's notice (_refuse) must not wait for them (it would wait its whole timeout)
            self._informed = {r for r in sends if r not in undelivered and r not in lost}
        elif undelivered:
            # The decision stands on rank 0 (a commit callback may already have made a checkpoint visible),
            # but the group cannot go on with ranks that missed the outcome.
            self._poison_by(
                failure_report(
                    op=op,
                    phase="reply",
                    step=step,
                    summary=f"the outcome could not be delivered to {rank_list(sorted(undelivered))}",
                    failures=undelivered,
                    poison=True,
                ),
                held,
            )
        if failure is not None:
            raise failure_error(failure)
        return report[1]

    def _follow(
        self, op: str, step: int | None, own: Header, own_payload: bytes, entered: float, budget: float
    ) -> Json:
        """Ranks other than 0: send, then wait for rank 0's reply until ``budget`` seconds after ``entered``."""
        deadline = entered + budget
        up = [torch.tensor(own.words()), _byte_tensor(own_payload)]
        sent: list[Any] = []
        header_buf = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        held: list[object] = [up, sent, header_buf]
        try:
            sent += self._send(up, 0, (_TAG_UP_HEADER, _TAG_UP_PAYLOAD))
            self._irecv(header_buf, 0, _TAG_DOWN_HEADER).wait(seconds(deadline - time.monotonic()))
            header = Header.parse(header_buf.tolist())
            problem = self._check_header(header, own, 0)
            if problem is not None or header is None:
                raise _OutOfStep(problem)
            buf = torch.empty(header.nbytes, dtype=torch.uint8)
            held.append(buf)
            if header.nbytes:
                self._irecv(buf, 0, _TAG_DOWN_PAYLOAD).wait(seconds(max(deadline - time.monotonic(), self.timeout_s)))
            down = decode_json(buf.numpy().tobytes())
            self.last_timing = {"wait_s": time.monotonic() - entered, "bytes_out": float(len(own_payload))}
        except Exception as exc:
            if isinstance(exc, _OutOfStep):
                what = str(exc)
            elif "timed out" in str(exc).lower():
                what = f"no answer from rank 0 within {budget:g} s (rank 0 hung, dead, or not calling {op})"
            else:
                what = f"rank 0 unreachable during {op}"
            failure = failure_report(
                op=op,
                phase="reply",
                step=step,
                summary=what,
                failures={
                    0: report_error(ConnectionError(what))
                    if isinstance(exc, _OutOfStep)
                    else _comm_report(exc, what=what)
                },
                poison=True,
            )
            raise self._poison_by(failure, held) from exc
        if not isinstance(down, dict) or not isinstance(down.get("ok"), bool):
            raise self._poison_with(held, op, step, "rank 0 sent a reply of unknown shape")
        if down["ok"]:
            self._finish_sends(sent, held, op, step)
            return down.get("doc")
        verdict = down.get("failure")
        if not isinstance(verdict, dict):
            raise self._poison_with(held, op, step, "rank 0 sent a failure without a report")
        if verdict.get("poison"):
            raise self._poison_by(verdict, held)
        self._finish_sends(sent, held, op, step)
        raise failure_error(verdict)

    def _finish_sends(self, sent: list[Any], held: list[object], op: str, step: int | None) -> None:
        # Rank 0 answered cleanly, so it consumed this rank's messages: the sends are complete.
        try:
            for work in sent:
                work.wait(seconds(self.timeout_s))
        except Exception as exc:
            raise self._poison_with(held, op, step, f"completing this rank's {op} message failed: {exc}") from exc

    def _poison_with(self, held: list[object], op: str, step: int | None, text: str) -> DistributedCheckpointError:
        failure = failure_report(
            op=op,
            phase="reply",
            step=step,
            summary=text,
            failures={self._rank: report_error(ConnectionError(text))},
            poison=True,
        )
        return self._poison_by(failure, held)


def _judge(
    op: str,
    step: int | None,
    envelopes: dict[int, Json],
    docs: list[Json],
    lost: dict[int, dict[str, Json]],
    skewed: set[int],
    reply: Reply,
    fail_phase: str,
    timeout_s: float,
) -> tuple[dict[str, Json] | None, Json]:
    """Rank 0's verdict: (failure report, None) or (None, reply document)."""
    refused: dict[int, dict[str, Json]] = {}
    for r, env in envelopes.items():
        if not isinstance(env, dict) or not isinstance(env.get("ok"), bool):
            lost[r] = report_error(ConnectionError(f"rank {r} sent a {op} message of unknown shape"))
        elif env["ok"]:
            docs[r] = env.get("doc")
        else:
            err = env.get("error")
            refused[r] = err if isinstance(err, dict) else report_error(RuntimeError(str(err)))
    if lost or refused:
        parts = []
        silent = sorted(r for r, rep in lost.items() if rep.get("type") == "TimeoutError")
        broken = sorted(r for r in lost if r not in silent and r not in skewed)
        if silent:
            parts.append(f"{rank_list(silent)} sent nothing within {timeout_s:g} s")
        if skewed:
            parts.append(f"{rank_list(sorted(skewed))} made a different call (out of step)")
        if broken:
            parts.append(f"the connection to {rank_list(broken)} failed")
        if refused:
            parts.append(f"{rank_list(sorted(refused))} could not take part")
        return (
            failure_report(
                op=op,
                phase="collect",
                step=step,
                summary="; ".join(parts),
                failures={**refused, **lost},
                poison=bool(lost),
            ),
            None,
        )
    try:
        return None, reply(docs)
    except Decline as declined:
        return declined.report, None
    except Exception as exc:
        summary = f"rank 0's {fail_phase} raised {type(exc).__name__}"
        failures = {0: report_error(exc)}
        return failure_report(
            op=op, phase=fail_phase, step=step, summary=summary, failures=failures, poison=False
        ), None


class _OutOfStep(ConnectionError):
    """Rank 0's reply belongs to another call: the ranks' call sequences diverged."""


def _byte_tensor(data: bytes) -> torch.Tensor:
    # torch.frombuffer refuses an empty buffer
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _arrived(headers: torch.Tensor, pending: set[int]) -> list[int]:
    """The pending ranks whose header is complete in ``headers`` (gloo writes receives in place; the check
    word rejects a header read while its bytes are still arriving)."""
    index = torch.tensor(sorted(pending), dtype=torch.int64)
    rows = headers.index_select(0, index)
    check = rows[:, 0]
    for col in range(1, HEADER_WORDS - 1):
        check = torch.bitwise_xor(check, rows[:, col])
    complete = (rows[:, 0] == MAGIC) & (check == rows[:, HEADER_WORDS - 1])
    return [int(r) for r in index[complete].tolist()]
