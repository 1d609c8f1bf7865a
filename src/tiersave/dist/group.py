"""The coordination group: bounded, named-failure JSON exchanges between the ranks of a job.

Scope: creating tiersave's own gloo group, knowing each rank's node identity, and one primitive, the
*exchange*, on which every public call is built: every rank sends one JSON document to rank 0; rank 0
gathers them (waiting at most ``timeout_s``), computes one reply (or a failure report), and sends it to every
rank; every rank returns that reply or raises the same :class:`~tiersave.errors.DistributedCheckpointError`.
One exchange is one gather plus one broadcast, whatever the call.

Anti-scope: what the documents mean (the two-phase commit decision is in ``vote.py``), storage, manifests.

The exchange is point-to-point messages on the group, not gloo's collectives, so that the missing ranks
can be named on every rank: see ``channel.py`` for why and how.

Deadlines (all measured from the moment the rank enters the call):

- rank 0 waits at most ``timeout_s`` for every peer's document (arrival skew between ranks must fit in it);
- followers wait at most ``timeout_s + reply_allowance_s`` for rank 0's reply, where the allowance is the
  vote's ``commit_timeout_s`` (rank 0 runs the commit callback in between) and ``timeout_s`` otherwise;
- a rank that crashes or is killed closes its connections: a follower waiting on a dead rank 0 raises at
  once; rank 0 names a dead follower at its deadline at the latest.

Failure semantics: a *clean* failure (a rank voted no, values disagree, rank 0's callback raised, a rank's
document was not JSON) raises on every rank and leaves the group usable. A *communication* failure (a rank
sent nothing in time, a connection closed, ranks calling in different orders) raises on every rank that can
still be reached and *poisons* the group: a message may still be in flight, so the sequence of exchanges
cannot be resumed safely, and every later call raises at once, with the first failure as ``__cause__``
(rank 0's first such call also sends that failure to every rank it can reach and returns once the ranks it
does not name have it, so none waits for a reply, and none names rank 0 for closing its connections after).

Thread safety and call order: every rank must make the same calls in the same order (as with any
collective); a call's sequence number and operation are checked, so a divergence is reported, not
misread. Calls may come from any thread, including a background thread finishing an async save, but one at
a time per rank (a lock serializes them); a decision or commit callback must not call the group again.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError
from .channel import Channel, seconds
from .identity import NodeIdentity, derive_identities, identity_claim
from .vote import CommitCallback, CommitOutcome, decide_votes, vote_document
from .wire import Decline, Json, failure_report, rank_list, report_error, show

__all__ = ["CoordinationGroup", "NodeIdentity"]


class CoordinationGroup:
    """tiersave's channel between the ranks of a job; create it on every rank, in the same order.

    Construction is itself collective: it creates the gloo group (``torch.distributed.new_group`` is a call
    every rank of the default group makes, bounded by the default group's timeout) and runs one exchange that
    learns every rank's :class:`NodeIdentity` and agrees on :attr:`nonce`.

    Thread safety: every method may be called from any thread (e.g. the daemon thread that finishes an async
    save), one call at a time per rank (a lock serializes them), provided every rank issues the same calls in
    the same order; a divergence is detected and raised, never silently mismatched. Callbacks (``commit``)
    must not call the group.

    Args:
        timeout_s: how long rank 0 waits for the ranks' documents in each call (see the module docstring for
            the followers' deadline). It must cover the skew between ranks reaching a call, e.g. one rank
            finishing its shard writes later than the others.
        process_group: use this group instead of creating one. It must carry CPU tensors (gloo): never pass
            an NCCL-only group. Every rank of it must construct the :class:`CoordinationGroup`.
        node_rank: this rank's node index (default: ``GROUP_RANK`` from torchrun, else derived from hostnames).
        local_rank: this rank's index on its node (default: ``LOCAL_RANK``, else derived).
        hostname: this host's name (default: :func:`socket.gethostname`).
        max_message_bytes: the largest document accepted from a rank; a header announcing more is treated as
            a protocol failure.

    Raises:
        ConfigError: ``torch.distributed`` is not initialized, this rank is not in ``process_group``, the
            group cannot carry CPU tensors, or ``timeout_s`` is not positive (raised before any communication).
        DistributedCheckpointError: the setup exchange failed (ranks claiming the same node and local rank,
            a rank missing).
    """

    def __init__(
        self,
        *,
        timeout_s: float = 600.0,
        process_group: Any = None,
        node_rank: int | None = None,
        local_rank: int | None = None,
        hostname: str | None = None,
        max_message_bytes: int = 1 << 30,
    ) -> None:
        if not (timeout_s > 0):
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "tiersave's coordination group needs torch.distributed initialized first "
                "(torch.distributed.init_process_group)"
            )
        if process_group is None:
            process_group = dist.new_group(backend="gloo", timeout=seconds(timeout_s))
        else:
            backend = str(dist.get_backend(process_group))
            if "gloo" not in backend:
                raise ConfigError(
                    f"process_group uses backend {backend!r}; tiersave's coordination sends small CPU tensors "
                    "and needs a gloo group (the default creates one; never pass the training's NCCL group)"
                )
        if dist.get_rank(process_group) < 0:
            raise ConfigError("this rank is not a member of process_group")
        self._channel = Channel(process_group, timeout_s=float(timeout_s), max_message_bytes=int(max_message_bytes))
        self._pg = process_group
        self._rank = dist.get_rank(process_group)
        self._world = dist.get_world_size(process_group)
        self._identities, self.nonce = self._setup(node_rank, local_rank, hostname)

    # ----------------------------------------------------------------- identity

    @property
    def process_group(self) -> Any:
        """The torch process group the exchanges run on."""
        return self._pg

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world

    @property
    def is_coordinator(self) -> bool:
        """True on rank 0, which gathers, decides and runs commit callbacks."""
        return self._rank == 0

    @property
    def identity(self) -> NodeIdentity:
        """This rank's :class:`NodeIdentity`."""
        return self._identities[self._rank]

    @property
    def identities(self) -> tuple[NodeIdentity, ...]:
        """Every rank's :class:`NodeIdentity`, by rank (the same tuple on every rank)."""
        return self._identities

    @property
    def timeout_s(self) -> float:
        """Rank 0's deadline for gathering the ranks' documents in each call."""
        return self._channel.timeout_s

    @property
    def poisoned(self) -> bool:
        """True once a communication failure made the group unusable (every call then raises at once)."""
        return self._channel.poison is not None

    @property
    def last_timing(self) -> dict[str, float]:
        """Where this rank's last call spent its time, in seconds: on rank 0 ``gather_s`` (entering the call
        to every document in), ``decide_s`` (the decision, a vote's commit callback included) and
        ``reply_s`` (sending the outcome), ``bytes_in`` (the documents' size); on the others ``wait_s``
        (entering the call to the reply in) and ``bytes_out``. After a failed call, what was measured before
        it failed (possibly nothing)."""
        return dict(self._channel.last_timing)

    def _setup(
        self, node_rank: int | None, local_rank: int | None, hostname: str | None
    ) -> tuple[tuple[NodeIdentity, ...], str]:
        claim: Json = None
        error: BaseException | None = None
        try:
            claim = identity_claim(node_rank, local_rank, hostname)
        except ConfigError as exc:
            error = exc  # reported through the exchange so every rank fails, none hangs
        reply = self._channel.exchange("setup", None, claim, derive_identities, error=error)
        assert isinstance(reply, dict)
        rows = reply["identities"]
        nonce = reply["nonce"]
        assert isinstance(rows, list)
        assert isinstance(nonce, str)
        identities = tuple(NodeIdentity(**row) for row in rows if isinstance(row, dict))  # type: ignore[arg-type]
        return identities, nonce

    # ----------------------------------------------------------------- public calls

    def gather_json(self, doc: Json, *, step: int | None = None) -> list[Json] | None:
        """Gather one JSON document per rank to rank 0.

        Returns:
            On rank 0, the documents by rank; on the other ranks, None (returning at all means rank 0 got
            every document).
        """
        gathered: list[list[Json]] = []

        def reply(docs: list[Json]) -> Json:
            gathered.append(docs)
            return None

        self._channel.exchange("gather", step, doc, reply)
        return gathered[0] if gathered else None

    def broadcast_json(self, doc: Json = None, *, step: int | None = None) -> Json:
        """Rank 0's ``doc``, on every rank (the other ranks' ``doc`` is ignored)."""
        return self._channel.exchange("broadcast", step, doc if self._rank == 0 else None, lambda docs: docs[0])

    def all_gather_json(self, doc: Json, *, step: int | None = None) -> list[Json]:
        """Every rank's document, by rank, on every rank. Rank 0 sends the whole list to each rank: meant for
        small documents (fingerprints, identities), not for shard listings at large world sizes."""
        reply = self._channel.exchange("all_gather", step, doc, lambda docs: docs)
        assert isinstance(reply, list)
        return reply

    def agree(self, value: Json, *, what: str, step: int | None = None) -> None:
        """Check that every rank passed the same ``value`` (a step, a fingerprint of a replicated tensor).

        Args:
            value: this rank's value; compared after a JSON round trip.
            what: what the value is, for the error message (e.g. ``"fingerprint of model.weight"``).
            step: the step concerned, for the error message.

        Raises:
            DistributedCheckpointError: on every rank, naming each rank whose value differs from rank 0's,
                with both values. The group stays usable.
        """

        def reply(docs: list[Json]) -> Json:
            reference = docs[0]
            differ = {r: doc for r, doc in enumerate(docs) if doc != reference}
            if not differ:
                return None
            failures = {
                r: report_error(ValueError(f"{what} is {show(doc)} on rank {r} but {show(reference)} on rank 0"))
                for r, doc in differ.items()
            }
            summary = f"{what} differs on {rank_list(sorted(differ))} from rank 0's {show(reference)}"
            raise Decline(
                failure_report(op="agree", phase="decide", step=step, summary=summary, failures=failures, poison=False)
            )

        self._channel.exchange("agree", step, value, reply)

    def new_nonce(self) -> str:
        """A fresh random token (16 hex digits) drawn by rank 0 and returned on every rank, e.g. to name a
        temporary prefix that all ranks of one checkpointer share without a collective at save start.
        :attr:`nonce` holds one agreed at construction."""
        token = self._channel.exchange("nonce", None, None, lambda docs: secrets.token_hex(8))
        assert isinstance(token, str)
        return token

    def vote(
        self,
        step: int,
        payload: Json = None,
        *,
        error: BaseException | None = None,
        commit: CommitCallback | None = None,
        commit_timeout_s: float | None = None,
    ) -> CommitOutcome:
        """The two-phase commit decision for ``step``: call on every rank once its part is durable (or failed).

        Every rank sends its vote to rank 0: yes with ``payload`` (what it wrote, e.g. its manifest entries)
        when ``error`` is None, no with ``error``'s type and message otherwise. Rank 0 decides commit only if
        every rank voted yes for the same step; only then it calls ``commit`` with the payloads by rank (it
        writes the global manifest: that write is the commit point) and sends the outcome to every rank.
        One gather and one broadcast per call, whatever the number of tensors. May run on a background
        thread, as long as every rank makes its coordination calls in the same order.

        Args:
            step: the step being saved; every rank must vote for the same one.
            payload: this rank's JSON document (ignored when ``error`` is given).
            error: why this rank failed; makes this a no vote.
            commit: on rank 0, the callback that makes the checkpoint visible, called at most once with the
                payloads by rank; its JSON return value reaches every rank as :attr:`CommitOutcome.result`.
                Ignored on the other ranks (passing the same callable everywhere is fine).
            commit_timeout_s: how much longer than ``timeout_s`` the other ranks wait for the outcome, to
                cover the commit callback (default: ``timeout_s``).

        Returns:
            The same :class:`CommitOutcome` on every rank, after rank 0's ``commit`` returned.

        Raises:
            DistributedCheckpointError: on every rank, when any rank voted no (each named with its error),
                voted for another step, sent nothing in time or died, or when rank 0's ``commit`` raised.
                ``commit`` never ran unless the failure is its own. If rank 0 itself dies or hangs, the other
                ranks raise naming rank 0 and cannot know whether the commit happened: readers find out by
                looking for the checkpoint, as after any crash.
        """
        allowance = self._channel.timeout_s if commit_timeout_s is None else float(commit_timeout_s)
        doc, doc_error = vote_document(step, payload, error)
        reply = self._channel.exchange(
            "vote",
            step,
            doc,
            lambda docs: decide_votes(step, docs, commit),
            error=doc_error,
            reply_allowance_s=allowance,
            fail_phase="commit",
        )
        result = reply.get("result") if isinstance(reply, dict) else None
        return CommitOutcome(step=step, result=result, world_size=self._world)
