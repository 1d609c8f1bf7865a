"""Peer-memory replicas, the wire: a node's memory tier served read-only to its peers, and the verified copy
of one node's part of a checkpoint from a peer into this node's memory.

Every node leader (local rank 0) of a job whose memory tier has ``replicas=K`` runs one :class:`ReplicaServer`.
It answers, over plain TCP, four requests: the committed steps of a namespace, a small file (a manifest), the
bytes of one shard file (streamed), and "replicate step N from node n at address A" (the server then pulls
node n's part of step N into ``<shm>/replicas/<name>/node-<n>/`` with :func:`fetch_part`). A namespace is
``own`` (the node's memory tier) or ``node-<n>`` (the replica it holds of node n). :func:`fetch_part` is the
one copy both directions use: replication (a holder pulls a node's part) and restore after node loss (the
replacement pulls its node's part back from a holder).

Integrity: the manifest is parsed and validated first; every chunk of every tensor is checked against its
CRC-32C as it arrives, before it is written; the copy is written under a temporary directory and renamed into
place (the memory tier's own rename commit) only when every shard of the node's ranks has arrived and
verified, so a torn or corrupted transfer is never visible. Only a globally committed step is ever served
(the source lists committed steps only). Every request carries the job's token (agreed on the coordination
group), so a stranger on the network gets nothing; every socket operation has a timeout.

Scope: the protocol, the server, the client and the verified copy of a node's part. Anti-scope: which nodes
hold whose replica and when to replicate (replication.py), the coordination group (dist/), the tiers.

Nothing is ever unpickled: headers are JSON, payloads are raw bytes whose length the header gives.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

from ._crash import crashpoint
from .catalog import Catalog
from .commit import commit_for
from .errors import (
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    ObjectNotFoundError,
    StorageError,
    TiersaveError,
    TransientStorageError,
)
from .format.checksum import chunk_ranges, crc32c_hex
from .format.layout import MANIFEST_NAME, MAX_MANIFEST_BYTES, step_dirname
from .format.manifest import Manifest, TensorEntry
from .storage.base import BlobWriter, Storage, check_key
from .storage.posix.buffers import aligned_buffer

log = logging.getLogger(__name__)

__all__ = ["PeerClient", "PeerError", "ReplicaServer", "fetch_part"]

_HEADER = struct.Struct(">I")
_MAX_HEADER = 1 << 20
_BLOCK = 4 << 20  # server-side read size when streaming a shard


class PeerError(TransientStorageError):
    """A peer node did not answer, answered out of protocol, or reported an error."""


def _recv_exact(sock: socket.socket, out: memoryview, what: str) -> None:
    got = 0
    while got < len(out):
        n = sock.recv_into(out[got:])
        if n == 0:
            raise PeerError(f"{what}: the connection closed after {got} of {len(out)} bytes")
        got += n


def _send_doc(sock: socket.socket, doc: dict[str, Any]) -> None:
    data = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_doc(sock: socket.socket, what: str) -> dict[str, Any]:
    head = bytearray(_HEADER.size)
    _recv_exact(sock, memoryview(head), what)
    (size,) = _HEADER.unpack(head)
    if size > _MAX_HEADER:
        raise PeerError(f"{what}: a header of {size} bytes (at most {_MAX_HEADER})")
    body = bytearray(size)
    _recv_exact(sock, memoryview(body), what)
    try:
        doc = json.loads(body)
    except ValueError:
        raise PeerError(f"{what}: a header that is not JSON") from None
    if not isinstance(doc, dict):
        raise PeerError(f"{what}: a header that is not a JSON object")
    return doc


@dataclass(frozen=True)
class PeerAddress:
    """Where a node's replica server listens."""

    node: int
    host: str
    port: int

    def __str__(self) -> str:
        return f"node {self.node} ({self.host}:{self.port})"


def _send_file(conn: socket.socket, fd: int, offset: int, length: int, timeout_s: float, what: str) -> None:
    """Send ``length`` bytes of file ``fd`` from ``offset`` with ``sendfile``: the kernel copies page cache to
    the socket, with no read into a buffer of ours. Each wait for room in the socket is bounded."""
    end = offset + length
    with selectors.PollSelector() as selector:
        selector.register(conn, selectors.EVENT_WRITE)
        while offset < end:
            if not selector.select(timeout_s):
                raise PeerError(f"{what}: the receiver took nothing for {timeout_s:g} s")
            try:
                sent = os.sendfile(conn.fileno(), fd, offset, end - offset)
            except BlockingIOError:
                continue
            if sent == 0:
                raise CorruptCheckpointError(f"{what}: the file ends at byte {offset}, before {end}")
            offset += sent


class PeerClient:
    """Requests to one peer node's :class:`ReplicaServer`. One TCP connection per request; thread-safe.

    Args:
        peer: the peer's address.
        token: the job's token (the server refuses any other).
        timeout_s: the limit of every socket operation (connect, each send and receive).
    """

    def __init__(self, peer: PeerAddress, token: str, timeout_s: float) -> None:
        self.peer = peer
        self.token = token
        self.timeout_s = timeout_s

    @contextlib.contextmanager
    def _request(self, doc: dict[str, Any], *, timeout_s: float | None = None) -> Iterator[tuple[socket.socket, Any]]:
        what = f"{doc.get('op')} from {self.peer}"
        try:
            with socket.create_connection((self.peer.host, self.peer.port), timeout=self.timeout_s) as sock:
                sock.settimeout(timeout_s if timeout_s is not None else self.timeout_s)
                _send_doc(sock, {**doc, "token": self.token})
                reply = _recv_doc(sock, what)
                if not reply.get("ok"):
                    kind = ObjectNotFoundError if reply.get("type") == "ObjectNotFoundError" else PeerError
                    raise kind(f"{what}: {reply.get('type')}: {reply.get('message')}")
                yield sock, reply
        except TimeoutError:
            raise PeerError(f"{what}: no answer within {timeout_s or self.timeout_s:g} s") from None
        except OSError as exc:
            if isinstance(exc, TiersaveError):
                raise
            raise PeerError(f"{what}: {exc}") from None

    def steps(self, ns: str) -> list[int]:
        """The committed steps of namespace ``ns`` on the peer (empty if it holds none)."""
        with self._request({"op": "steps", "ns": ns}) as (_, reply):
            steps = reply.get("steps")
        if not isinstance(steps, list) or not all(isinstance(s, int) for s in steps):
            raise PeerError(f"steps from {self.peer}: a malformed answer")
        return sorted(steps)

    def get(self, ns: str, key: str, max_bytes: int) -> bytes:
        """A whole small file (a manifest) of namespace ``ns``."""
        with self._request({"op": "get", "ns": ns, "key": key, "max_bytes": max_bytes}) as (sock, reply):
            size = reply.get("nbytes")
            if not isinstance(size, int) or not 0 <= size <= max_bytes:
                raise PeerError(f"get {key} from {self.peer}: a malformed size {size!r}")
            out = bytearray(size)
            _recv_exact(sock, memoryview(out), f"get {key} from {self.peer}")
        return bytes(out)

    def read_range(self, ns: str, key: str, size: int, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of file ``key`` (``size`` bytes on the peer) at ``offset``, received
        straight into ``out`` (no intermediate buffer): one connection per call, so calls from several threads
        run as parallel connections."""
        what = f"bytes {offset}..{offset + len(out)} of {key} from {self.peer}"
        doc = {"op": "stream", "ns": ns, "key": key, "size": size, "offset": offset, "length": len(out)}
        with self._request(doc) as (sock, _):
            try:
                _recv_exact(sock, out, what)
            except TimeoutError:
                raise PeerError(f"{what}: stalled for {self.timeout_s:g} s") from None

    @contextlib.contextmanager
    def stream(self, ns: str, key: str, size: int) -> Iterator[Callable[[memoryview], None]]:
        """The bytes of file ``key``, in order: yields ``read(view)``, which fills ``view`` with the next bytes."""
        what = f"shard {key} from {self.peer}"
        with self._request({"op": "stream", "ns": ns, "key": key, "size": size}) as (sock, _):

            def read(view: memoryview) -> None:
                try:
                    _recv_exact(sock, view, what)
                except TimeoutError:
                    raise PeerError(f"{what}: stalled for {self.timeout_s:g} s") from None

            yield read

    def replicate(self, source: PeerAddress, step: int, ranks: list[int], timeout_s: float) -> dict[str, Any]:
        """Ask the peer to pull ``source``'s part (``ranks``) of ``step``; returns its report once published."""
        doc = {"op": "replicate", "step": step, "ranks": ranks, "source": [source.node, source.host, source.port]}
        with self._request(doc, timeout_s=timeout_s) as (_, reply):
            return dict(reply)


def fetch_part(
    client: PeerClient, ns: str, dst: Storage, step: int, ranks: set[int], *, chunk_limit: int = 64 << 20
) -> int:
    """Copy the part of committed ``step`` that ``ranks`` wrote, from namespace ``ns`` on a peer into ``dst``
    (a memory tier or a replica namespace): manifest first, every chunk checked against its CRC-32C on arrival,
    published by rename only when complete. Returns the shard bytes copied (0 if ``dst`` already holds it).

    Raises:
        CorruptCheckpointError: a chunk does not match its checksum, or the peer holds no shard of ``ranks``.
        PeerError, ObjectNotFoundError: the peer is unreachable or does not hold the step.
    """
    catalog = Catalog(dst)
    if step in catalog.steps():
        return 0
    where = f"step {step} from {client.peer} ({ns})"
    data = client.get(ns, f"{step_dirname(step)}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
    manifest = Manifest.parse(data, path=where, expect_step=step)
    shards = [i for i, s in enumerate(manifest.shards) if s.rank in ranks]
    if not shards:
        raise CorruptCheckpointError(f"{where}: the manifest lists no shard of ranks {sorted(ranks)}", step=step)
    by_shard: dict[int, list[Any]] = {i: [] for i in shards}
    for entry in manifest.tensors.values():
        if entry.shard in by_shard:
            by_shard[entry.shard].append(entry)
    # receive into one buffer while the other is checked and written; sized to the largest chunk needed, and
    # mapped rather than zero-filled (a 64 MiB chunk would otherwise cost a memset per fetch)
    largest = max((min(e.nbytes, manifest.chunk_bytes) for v in by_shard.values() for e in v), default=0)
    buffers = [aligned_buffer(max(4096, min(largest, chunk_limit))) for _ in range(2)]
    commit = commit_for(dst)
    prefix = commit.begin(step)
    copied = 0
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="tiersave-replica-check") as checker:
            for index in shards:
                shard = manifest.shards[index]
                writer = dst.open_writer(f"{prefix}/{shard.file.rsplit('/', 1)[-1]}", size_hint=shard.size)
                try:
                    with client.stream(ns, f"{step_dirname(step)}/{shard.file}", shard.size) as read:
                        entries = sorted(by_shard[index], key=lambda t: t.offset)
                        _copy_shard(read, writer, entries, shard.size, manifest.chunk_bytes, buffers, checker, where)
                    writer.finish(shard.size)
                except BaseException:
                    writer.abort()
                    raise
                copied += shard.size
        crashpoint("replica_received")  # every shard here, not yet published (not one of a save's CRASHPOINTS)
        commit.commit(prefix, step, data)
    except BaseException:
        with contextlib.suppress(Exception):
            commit.abort(prefix)
        raise
    return copied


def _copy_shard(
    read: Callable[[memoryview], None],
    writer: BlobWriter,
    entries: list[TensorEntry],
    size: int,
    chunk_bytes: int,
    buffers: list[memoryview],
    checker: Executor,
    where: str,
) -> None:
    """Receive one shard's bytes in order; check each tensor chunk against its CRC-32C and write it (on
    ``checker``, overlapping the next chunk's receive: two buffers in turn). Padding is read and dropped."""
    pending: list[Future[None] | None] = [None, None]
    scratch = memoryview(bytearray(min(1 << 20, len(buffers[0]))))

    def check(view: memoryview, entry: TensorEntry, j: int, at: int) -> None:
        if crc32c_hex(view) != entry.crc32c[j]:
            raise CorruptCheckpointError(
                f"{where}: chunk {j} of tensor {entry.name} does not match its checksum; the replica is not used",
                file=entry.name,
            )
        writer.write_at(at, view)

    def skip(n: int) -> None:
        while n > 0:
            gap = min(n, len(scratch))
            read(scratch[:gap])
            n -= gap

    position, turn = 0, 0
    try:
        for entry in entries:
            for j, (off, length) in enumerate(chunk_ranges(entry.nbytes, chunk_bytes)):
                at = entry.offset + off
                skip(at - position)  # padding between tensors
                previous = pending[turn]
                if previous is not None:
                    previous.result()  # this buffer's last chunk is checked and written: reuse it
                view = buffers[turn][:length]
                read(view)
                position = at + length
                pending[turn] = checker.submit(check, view, entry, j, at)
                turn ^= 1
        skip(size - position)  # the tail padding: the stream is read to its end
    finally:  # no check may still write when the caller aborts the writer
        for future in pending:
            if future is not None:
                futures_wait([future])
    for future in pending:
        if future is not None:
            future.result()


class ReplicaServer:
    """One node's replica server: serves its memory tier and the replicas it holds, read-only, and pulls the
    replicas its peers ask it to hold.

    Args:
        host: the address to listen on (and that peers connect to).
        token: the job's token; requests without it are refused.
        timeout_s: the limit of every socket operation.
        namespace: ``ns`` -> the storage it names (``own``, ``node-<n>``; created on first use).
        on_replica: called after a replica of node n's ``step`` was published (retention of that namespace).
        node: this node's index (in messages).
    """

    def __init__(
        self,
        host: str,
        token: str,
        timeout_s: float,
        namespace: Callable[[str], Storage],
        on_replica: Callable[[int, int], None],
        node: int,
    ) -> None:
        self.token = token
        self.timeout_s = timeout_s
        self.node = node
        self._namespace = namespace
        self._on_replica = on_replica
        self._locks: dict[int, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.address = PeerAddress(node, host, int(self._sock.getsockname()[1]))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"tiersave-replica-{node}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting requests (requests being served finish on their own, within their timeouts)."""
        self._closed.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), name="tiersave-replica-req", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout_s)
            try:
                doc = _recv_doc(conn, "a request")
                if doc.get("token") != self.token:
                    _send_doc(conn, {"ok": False, "type": "PermissionDeniedError", "message": "wrong job token"})
                    return
                self._dispatch(conn, doc)
            except (TiersaveError, OSError) as exc:
                with contextlib.suppress(OSError):
                    _send_doc(conn, {"ok": False, "type": type(exc).__name__, "message": str(exc)})
            except Exception as exc:  # a bug must not kill the server thread silently
                log.warning("replica server of node %d: %s", self.node, exc, exc_info=True)
                with contextlib.suppress(OSError):
                    _send_doc(conn, {"ok": False, "type": type(exc).__name__, "message": str(exc)})

    def _storage(self, doc: dict[str, Any]) -> Storage:
        ns = doc.get("ns")
        if ns != "own" and not (isinstance(ns, str) and ns.startswith("node-") and ns[5:].isdigit()):
            raise ConfigError(f"no namespace {ns!r}")
        return self._namespace(ns)

    def _dispatch(self, conn: socket.socket, doc: dict[str, Any]) -> None:
        op = doc.get("op")
        if op == "steps":
            _send_doc(conn, {"ok": True, "steps": Catalog(self._storage(doc)).steps()})
        elif op == "get":
            key, max_bytes = doc.get("key"), doc.get("max_bytes")
            if not isinstance(key, str) or not isinstance(max_bytes, int):
                raise ConfigError("get needs a key and max_bytes")
            check_key(key)
            data = self._storage(doc).get(key, max_bytes=max_bytes)
            _send_doc(conn, {"ok": True, "nbytes": len(data)})
            conn.sendall(data)
        elif op == "stream":
            self._stream(conn, doc)
        elif op == "replicate":
            self._replicate(conn, doc)
        else:
            raise ConfigError(f"unknown request {op!r}")

    def _stream(self, conn: socket.socket, doc: dict[str, Any]) -> None:
        key, size = doc.get("key"), doc.get("size")
        offset, length = doc.get("offset", 0), doc.get("length", size)
        if not isinstance(key, str) or not isinstance(size, int) or size < 0:
            raise ConfigError("stream needs a key and a size")
        if not isinstance(offset, int) or not isinstance(length, int) or not 0 <= offset <= offset + length <= size:
            raise ConfigError(f"stream: the range {offset!r}+{length!r} is not within the {size} bytes of {key}")
        check_key(key)
        reader = self._storage(doc).open_reader(key)
        try:
            if reader.size != size:
                raise CorruptCheckpointError(f"{key} is {reader.size} bytes on node {self.node}, not {size}")
            _send_doc(conn, {"ok": True, "nbytes": length})
            fileno = getattr(reader, "fileno", None)
            if callable(fileno) and length:  # a file: the kernel copies page cache -> socket (no read, no buffer)
                _send_file(conn, int(fileno()), offset, length, self.timeout_s, f"{key} on node {self.node}")
                return
            block = memoryview(bytearray(min(_BLOCK, max(length, 1))))
            for at in range(offset, offset + length, len(block)):
                view = block[: min(len(block), offset + length - at)]
                reader.read_into(at, view)
                conn.sendall(view)
        finally:
            reader.close()

    def _replicate(self, conn: socket.socket, doc: dict[str, Any]) -> None:
        step, ranks, source = doc.get("step"), doc.get("ranks"), doc.get("source")
        if (
            not isinstance(step, int)
            or not isinstance(ranks, list)
            or not all(isinstance(r, int) for r in ranks)
            or not (isinstance(source, list) and len(source) == 3)
        ):
            raise ConfigError("replicate needs a step, ranks and a source")
        node, host, port = source
        if not isinstance(node, int) or not isinstance(host, str) or not isinstance(port, int) or node == self.node:
            raise ConfigError(f"replicate: a malformed source {source!r}")
        peer = PeerClient(PeerAddress(node, host, port), self.token, self.timeout_s)
        with self._locks_guard:
            lock = self._locks.setdefault(node, threading.Lock())
        with lock:  # one copy at a time per source node: they commit into one namespace
            try:
                copied = fetch_part(peer, "own", self._namespace(f"node-{node}"), step, set(ranks))
            except FormatError as exc:
                raise CorruptCheckpointError(f"node {self.node} refused the replica: {exc}", step=step) from None
            self._on_replica(node, step)
        _send_doc(conn, {"ok": True, "bytes": copied, "holder": self.node})


def is_copy_error(exc: BaseException) -> bool:
    """Whether ``exc`` is about a copy (unreachable peer, missing or corrupt replica), not a bug."""
    return isinstance(exc, (StorageError, FormatError, OSError))
