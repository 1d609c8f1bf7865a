"""Peer-memory replicas: each node's part of a checkpoint in the memory tier is also held in the memory of K
other nodes, so the replacement of a lost node restores from a peer's RAM instead of the durable store.

``Tier("mem://NAME", replicas=K)`` as the first tier of a collective Checkpointer on several nodes turns this on:

- Placement (:func:`ring`, :func:`holders`): the nodes are ordered on a ring that alternates failure domains
  (``failure_domain=`` or ``TIERSAVE_FAILURE_DOMAIN``, e.g. a rack name; default: every node is its own), and
  node n's part goes to the K next nodes on the ring, preferring nodes outside n's domain. Every rank computes
  the same placement from the identities and domains exchanged once, at construction.
- Replication (:meth:`Replicas.after_commit`): once a step is globally committed, the node leader (local rank
  0) asks each of its node's holders to pull the node's part (``replica.fetch_part``: CRC of every chunk on
  arrival, published by rename when complete) into ``<shm>/replicas/NAME/node-<n>/``; on a background thread
  of its own, so the training loop never waits for it. ``handle.tier_result("<tier>.replica")`` reports it on
  node leaders; ``Checkpointer.close()`` and ``wait()`` wait for it. Retention of each replica namespace follows
  the tier's policy (applied by the holder after each replica it publishes).
- Restore (:meth:`Replicas.read`): a rank whose memory tier lacks the step the job restores (a replacement
  node, its memory empty) reads its part straight from the first holder that has a valid copy
  (``replica_read``: streamed into the tensors over parallel connections, each chunk checked once); the node
  leader then pulls the node's part into its memory tier in the background. No valid replica raises an error
  naming each holder and why, and the restore falls back to the next tier.

Scope: placement, the per-Checkpointer replica set (server, replicator thread, peer read on restore).
Anti-scope: the wire and the verified copy (replica.py), the commit of the memory tier (saving.py), which copy
the ranks restore (restore.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ._futures import running_future
from .catalog import Catalog, CheckpointInfo, OpenCheckpoint
from .engine.pool import DaemonThreadPool
from .errors import CheckpointNotFoundError, ConfigError, TiersaveError
from .events import background_warning
from .format.view import RankPart
from .partdrain import PartDrains
from .replica import PeerAddress, PeerClient, ReplicaServer, fetch_part
from .replica_read import read_from_holders
from .storage.base import Storage
from .storage.memory import MemoryStorage

if TYPE_CHECKING:  # pragma: no cover
    from .collective import Collective
    from .dist import CoordinationGroup
    from .handle import SaveHandle
    from .tiers import TierChain, TierRuntime

__all__ = ["Replicas", "holders", "ring"]

T = TypeVar("T")

DOMAIN_ENV = "TIERSAVE_FAILURE_DOMAIN"
HOST_ENV = "TIERSAVE_REPLICA_HOST"
_REPLICATE_GBPS = 0.05  # the slowest transfer allowed before a replication times out (on top of timeout_s)


def ring(domains: Mapping[int, str]) -> list[int]:
    """The nodes on a ring whose neighbours are in different failure domains where possible: domains in order
    of their first node, their nodes taken in turn (rack A's first, rack B's first, rack A's second...)."""
    by_domain: dict[str, list[int]] = {}
    for node in sorted(domains):
        by_domain.setdefault(domains[node], []).append(node)
    queues = list(by_domain.values())
    out: list[int] = []
    while any(queues):
        out.extend(q.pop(0) for q in queues if q)
    return out


def holders(node: int, domains: Mapping[int, str], k: int) -> list[int]:
    """The ``k`` nodes that hold ``node``'s replica: the next ones on the ring, outside ``node``'s failure
    domain (and outside each other's) first, then any other node in ring order."""
    order = ring(domains)
    pos = order.index(node)
    after = [order[(pos + i) % len(order)] for i in range(1, len(order))]
    chosen: list[int] = []
    used = {domains[node]}
    for candidate in after:  # first pass: a domain not yet holding a copy
        if len(chosen) < k and domains[candidate] not in used:
            chosen.append(candidate)
            used.add(domains[candidate])
    for candidate in after:
        if len(chosen) < k and candidate not in chosen:
            chosen.append(candidate)
    return chosen


def _advertised_host() -> str:
    """The address peers reach this node at: ``TIERSAVE_REPLICA_HOST``, else the interface that routes to
    torchrun's ``MASTER_ADDR`` (no packet is sent), else the hostname's address."""
    explicit = os.environ.get(HOST_ENV)
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))
            return str(probe.getsockname()[0])
    return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class Layout:
    """Who is where, the same on every rank: each node's ranks, failure domain and replica server."""

    node: int
    ranks: dict[int, list[int]]
    domains: dict[int, str]
    addresses: dict[int, PeerAddress]
    k: int

    def holders(self, node: int) -> list[int]:
        return holders(node, self.domains, self.k)


class Replicas:
    """The peer-memory replicas of one Checkpointer's memory tier (every rank has one; the node leader
    serves and replicates). Collective construction: every rank builds it, in the same order.

    Args:
        tier: the first tier, a memory tier with ``replicas > 0``.
        group: the job's coordination group.
        failure_domain: this node's failure domain (None: ``TIERSAVE_FAILURE_DOMAIN``, else the node itself).

    Raises:
        ConfigError: more replicas than other nodes, or a memory tier that is not ``mem://``.
    """

    def __init__(self, tier: TierRuntime, group: CoordinationGroup, failure_domain: str | None = None) -> None:
        if not isinstance(tier.storage, MemoryStorage):
            raise ConfigError(f"replicas= needs a memory tier (mem://NAME), not {tier.storage.uri}")
        self.tier = tier
        self.storage: MemoryStorage = tier.storage
        self.k = tier.spec.replicas
        self.timeout_s = group.timeout_s
        self.group = group
        me = group.identity
        self.leader = me.local_rank == 0
        domain = failure_domain if failure_domain is not None else os.environ.get(DOMAIN_ENV) or f"node-{me.node_rank}"
        self._token = f"{group.nonce}-{self.storage.name}"
        self.server: ReplicaServer | None = None
        if self.leader and me.num_nodes > self.k:
            self.server = ReplicaServer(
                _advertised_host(), self._token, self.timeout_s, self.namespace, self._retain, me.node_rank
            )
        mine: Any = {"domain": str(domain), "addr": None}
        if self.server is not None:
            mine["addr"] = [self.server.address.host, self.server.address.port]
        try:
            rows = group.all_gather_json(mine)
        except BaseException:
            self.close(wait=False)
            raise
        ranks: dict[int, list[int]] = {}
        domains: dict[int, str] = {}
        addresses: dict[int, PeerAddress] = {}
        for ident, row in zip(group.identities, rows, strict=True):
            ranks.setdefault(ident.node_rank, []).append(ident.rank)
            if ident.local_rank == 0 and isinstance(row, dict):
                domains[ident.node_rank] = str(row.get("domain"))
                addr = row.get("addr")
                if isinstance(addr, list) and len(addr) == 2 and isinstance(addr[1], int):
                    addresses[ident.node_rank] = PeerAddress(ident.node_rank, str(addr[0]), addr[1])
        if len(ranks) <= self.k:
            self.close(wait=False)
            raise ConfigError(
                f"Tier({self.storage.uri!r}, replicas={self.k}) needs at least {self.k + 1} nodes; this job has "
                f"{len(ranks)}"
            )
        self.layout = Layout(me.node_rank, ranks, domains, addresses, self.k)
        self._pool = DaemonThreadPool(1, "tiersave-replicate") if self.leader else None
        self.result_name = f"{tier.name}.replica"

    @property
    def node(self) -> int:
        return self.layout.node

    def namespace(self, ns: str) -> Storage:
        """``own`` -> the memory tier; ``node-<n>`` -> the replica of node n held here."""
        if ns == "own":
            return self.storage
        return MemoryStorage(f"replicas/{self.storage.name}/{ns}")

    def _retain(self, node: int, step: int) -> None:
        """Holder, after publishing node ``node``'s replica of ``step``: the tier's retention on that namespace,
        and the leftovers of copies killed midway (their process is dead)."""
        try:
            Catalog(self.namespace(f"node-{node}")).prune(policy=self.tier.policy, leftovers=True)
        except TiersaveError as exc:
            background_warning(f"retention of node {node}'s replica on node {self.node} failed: {exc}")

    # -- replication ------------------------------------------------------------------------------

    def after_commit(self, handle: SaveHandle, chain: TierChain) -> None:
        """Commit thread of a node leader, once ``handle``'s step is committed in its memory: replicate its
        node's part in the background (the handle's ``<tier>.replica`` future reports it)."""
        if self._pool is None:
            return
        future: Future[CheckpointInfo | None] = running_future()
        handle.tiers[self.result_name] = future
        chain.protection.hold(0, handle.step)  # our own retention must not delete what the holders pull
        try:
            self._pool.submit(self._replicate, handle.step, chain, future)
        except BaseException as exc:  # closed (close() timed out while this commit ran): nothing will resolve it
            chain.protection.release(0, handle.step)
            future.set_exception(exc)
            raise

    def _replicate(self, step: int, chain: TierChain, future: Future[CheckpointInfo | None]) -> None:
        try:
            self._replicate_step(step, chain, future)
        except BaseException as exc:  # an unexpected error: the replica future still ends
            if not future.done():
                future.set_exception(exc)
            raise

    def _replicate_step(self, step: int, chain: TierChain, future: Future[CheckpointInfo | None]) -> None:
        started = time.perf_counter()
        failures: list[str] = []
        copied = 0
        try:
            me = self.layout.addresses[self.node]
            nbytes = self.storage.used_bytes()  # an upper bound of the step's size, for the timeout
            limit = self.timeout_s + nbytes / (_REPLICATE_GBPS * 1e9)
            for holder in self.layout.holders(self.node):
                address = self.layout.addresses.get(holder)
                if address is None:
                    failures.append(f"node {holder} runs no replica server")
                    continue
                client = PeerClient(address, self._token, self.timeout_s)
                try:
                    reply = client.replicate(me, step, self.layout.ranks[self.node], limit)
                    copied += int(reply.get("bytes", 0))
                except TiersaveError as exc:
                    failures.append(str(exc))
        finally:
            chain.protection.release(0, step)
        seconds = time.perf_counter() - started
        chain.log(
            {
                "step": step,
                "tier": self.result_name,
                "node": self.node,
                "outcome": "replica_failed" if failures else "replicated",
                "time": time.time(),
                "total_s": round(seconds, 6),
                "stored_bytes": copied,
                **({"error": "; ".join(failures)} if failures else {}),
            }
        )
        if failures:
            error = CheckpointNotFoundError(
                f"step {step}: node {self.node}'s replica is missing on a peer: " + "; ".join(failures)
            )
            background_warning(
                f"replicating step {step} of {self.storage.uri} from node {self.node} failed: {error}; the step "
                "is still in this node's memory and on the tiers it drains to"
            )
            future.set_exception(error)
            return
        try:
            future.set_result(self.tier.catalog.info(step))
        except TiersaveError as exc:  # deleted meanwhile by retention: replicated all the same
            future.set_exception(exc)

    def pools(self) -> list[DaemonThreadPool]:
        return [self._pool] if self._pool is not None else []

    def follow_up(self, first: Any) -> str:
        return f"the replication of tier {first.name} to its peers' memory"

    def close(self, wait: bool = True) -> None:
        """Wait for replication in flight (``wait``): this node's, then, in one exchange with every rank (all
        close their Checkpointer), every other node's, whose holders may be pulling from this node or into it;
        then stop the server."""
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=wait)
        if wait and hasattr(self, "layout") and not self.group.poisoned:
            try:
                self.group.all_gather_json(None)
            except TiersaveError as exc:
                background_warning(f"closing the replicas of {self.storage.uri}: the ranks did not all close: {exc}")
        if self.server is not None:
            self.server.close()
            self.server = None

    # -- restore ----------------------------------------------------------------------------------

    def restorable(self, step: int | None, tag: str | None = None) -> tuple[int | None, set[int]] | None:
        """Collective (every rank, in order): on rank 0, the steps every node can restore from memory, from its
        own copy or a peer's replica (``step``: that one only; ``tag``: those whose manifest carries it, or
        the one a movable tag names on any node); None on the other ranks. So that a job whose rank 0 is on
        the replacement node (its memory, and its movable tags, lost) still restores from memory.

        Returns:
            On rank 0: the step the movable tag ``tag`` names (the newest record among the nodes'; None if
            no node has one), and the usable steps.
        """
        spaces: dict[str, Catalog] = {"own": self.tier.catalog}
        if self.leader:
            for node in self.layout.ranks:
                if node != self.node:
                    with contextlib.suppress(TiersaveError):
                        ns = MemoryStorage(f"replicas/{self.storage.name}/node-{node}", create=False)
                        spaces[str(node)] = Catalog(ns)
        row: dict[str, Any] = {"node": self.node, "moved": _movable(self.tier.catalog, tag)}
        held: dict[str, Any] = {}
        for key, catalog in spaces.items():
            try:
                steps = catalog.steps()
            except TiersaveError:
                continue
            held[key] = [steps, _tagged(catalog, steps, tag)]
        row["held"] = held
        rows = self.group.gather_json(row)
        if rows is None:
            return None
        have: dict[int, set[int]] = {n: set() for n in self.layout.ranks}
        tagged: set[int] = set()
        moved: tuple[float, int] | None = None
        for got in rows:
            sender = got.get("node") if isinstance(got, dict) else None
            if not isinstance(got, dict) or not isinstance(sender, int):
                continue
            mark: Any = got.get("moved")
            if _tag_mark(mark) and (moved is None or (mark[0], mark[1]) > moved):  # the newest record wins
                moved = (float(mark[0]), mark[1])
            spaces_got: Any = got.get("held")
            for key, pair in spaces_got.items() if isinstance(spaces_got, dict) else ():
                node = sender if key == "own" else int(key) if key.isdigit() else -1
                if node in have and isinstance(pair, list) and len(pair) == 2:
                    have[node].update(_ints(pair[0]))
                    tagged.update(_ints(pair[1]))
        usable = set.intersection(*have.values())
        if moved is not None:
            usable &= {moved[1]}
        elif tag is not None:
            usable &= tagged
        return (moved[1] if moved is not None else None), usable if step is None else usable & {step}

    def read(self, step: int, read: Callable[[OpenCheckpoint], T]) -> tuple[T, int]:
        """Run ``read`` (the restore) over this rank's part of ``step`` streamed from the first holder of this
        node's replica that has a valid copy (``replica_read``: into the tensors, each chunk checked once).
        Then, on the node leader, the node's part is pulled into its memory tier in the background (``close``
        and ``wait`` wait for it), so that the node has its memory copy back. Returns ``read``'s result and
        the node it came from.

        Raises:
            CheckpointNotFoundError: no holder has a valid replica (the message names each and why).
        """
        clients: list[PeerClient] = []
        missing: list[str] = []
        for holder in self.layout.holders(self.node):
            address = self.layout.addresses.get(holder)
            if address is None:
                missing.append(f"node {holder} runs no replica server")
            else:
                clients.append(PeerClient(address, self._token, self.timeout_s))
        try:
            result, client = read_from_holders(clients, f"node-{self.node}", step, self.storage, read)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"step {step} is not in {self.storage.uri} on node {self.node}: " + "; ".join([*missing, str(exc)])
            ) from None
        if self._pool is not None:
            self._pool.submit(self._rebuild, client, step)
        return result, client.peer.node

    def _rebuild(self, client: PeerClient, step: int) -> None:
        """Node leader, after a restore read ``step`` from ``client``'s replica: the node's part into its own
        memory tier (``fetch_part``: verified, published by rename when complete; nothing if present)."""
        try:
            fetch_part(client, f"node-{self.node}", self.storage, step, set(self.layout.ranks[self.node]))
        except Exception as exc:  # on a pool thread: said, never lost (the restore itself succeeded)
            background_warning(
                f"step {step} was restored from node {client.peer.node}'s replica, but node {self.node}'s memory "
                f"copy of it could not be rebuilt: {exc}; the next save fills {self.storage.uri} again"
            )


def _tag_mark(mark: Any) -> bool:
    """Whether ``mark`` is a ``[time, step]`` pair (a node's movable tag, as exchanged)."""
    return isinstance(mark, list) and len(mark) == 2 and isinstance(mark[0], (int, float)) and isinstance(mark[1], int)


def _ints(value: Any) -> list[int]:
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _movable(catalog: Catalog, tag: str | None) -> list[float | int] | None:
    """``[time, step]`` of the movable tag ``tag`` in ``catalog`` (None: none, or its step is gone)."""
    if tag is None:
        return None
    try:
        moved = catalog.tags.resolve(tag)
    except TiersaveError:
        return None
    return None if moved is None else [moved.time, moved.step]


def _tagged(catalog: Catalog, steps: list[int], tag: str | None) -> list[int]:
    """The ``steps`` whose manifest in ``catalog`` carries ``tag`` (none without a tag)."""
    out = []
    for s in steps if tag is not None else ():
        with contextlib.suppress(TiersaveError):
            if tag in catalog.manifest(s).tags:
                out.append(s)
    return out


def read_copy(
    replicas: Replicas | None,
    tier: TierRuntime,
    step: int,
    read: Callable[[OpenCheckpoint], T],
    part: RankPart | None = None,
) -> tuple[T, str]:
    """Run ``read`` (the restore) over ``tier``'s copy of ``step``, or, when this node's memory lost it (a
    replacement node), over this rank's part streamed from a peer's replica. Returns ``read``'s result and
    where the bytes came from. ``part``: the rank's view of the manifest is all it parses (Catalog.open).
    Raises as :meth:`Replicas.read`."""
    if replicas is None or tier is not replicas.tier or step in tier.catalog.steps():
        with tier.catalog.open(step, part) as ckpt:
            return read(ckpt), tier.storage.uri
    result, node = replicas.read(step, read)
    return result, f"{tier.storage.uri} (pulled from node {node}'s replica)"


def node_ranks(group: CoordinationGroup) -> Sequence[int]:
    """The ranks on this rank's node."""
    node = group.identity.node_rank
    return [i.rank for i in group.identities if i.node_rank == node]


def attach(chain: TierChain, collective: Collective | None) -> Replicas | None:
    """Give a Checkpointer's chain its peer replicas (one of ``chain.companions``; None without ``replicas``),
    and, for a node-local first tier (a memory tier in a job on several nodes: each node holds its own ranks'
    shards) with later tiers, its part drains (partdrain.py). Collective: every rank calls it, in the same order.

    Raises:
        ConfigError: more replicas than other nodes, or a later tier the part drains do not support.
    """
    group = collective.group if collective is not None else None
    replicas: Replicas | None = None
    try:
        replicas = _attach(chain, group)
        if collective is not None and _node_local(chain, group) and len(chain.tiers) > 1:
            chain.companions.append(PartDrains(chain, collective))  # each node drains its own part
    except BaseException:
        if replicas is not None:
            replicas.close(wait=False)
        chain.shutdown(wait=False)
        raise
    if replicas is not None:
        chain.companions.append(replicas)  # waited for and closed with the chain's drains; found by restore
    return replicas


def _node_local(chain: TierChain, group: CoordinationGroup | None) -> bool:
    """Whether ``chain``'s first tier is a memory tier of a job on several nodes (each node holds its part)."""
    return group is not None and isinstance(chain.first.storage, MemoryStorage) and group.identity.num_nodes > 1


def of(chain: TierChain) -> Replicas | None:
    """The peer replicas of ``chain``'s memory tier, if it has them."""
    return next((c for c in chain.companions if isinstance(c, Replicas)), None)


def _attach(chain: TierChain, group: CoordinationGroup | None) -> Replicas | None:
    first = chain.first
    k = first.spec.replicas
    nodes = group.identity.num_nodes if group is not None else 1
    if k == 0:
        return None
    if nodes == 1:
        background_warning(
            f"Tier({first.storage.uri!r}, replicas={k}) has no effect: this is not a job on several nodes "
            "(torch.distributed with ranks on another node), so there is no peer to hold a replica"
        )
        return None
    assert group is not None
    return Replicas(first, group, first.spec.failure_domain)
