"""Peer-memory replicas: restoring a lost node's shards from a peer's RAM vs from local disk (cold), against
the loopback socket bandwidth, and the training loop's blocked time with replicas=1 vs replicas=0.

One run, interleaved repetitions (order rotated each repetition), median of ``--reps``:

- socket: raw loopback TCP, one connection, ``sendall`` of the state's bytes from a thread into ``recv_into``
  (the limit any transport over loopback has);
- peer: a lost node's restore from a peer, as ``Checkpointer.restore`` does it: the part streamed from a
  ``ReplicaServer`` (a thread serving the "peer's" memory directory with ``sendfile``) straight into new
  tensors, every chunk checked once on arrival, several chunks at once over parallel connections (the
  replacement's memory copy, pulled afterwards in the background, is not timed);
- pull: the earlier way, for comparison: ``replica.fetch_part`` into the replacement's memory, then the
  restore from that memory (two passes, two CRCs);
- disk: ``Checkpointer.restore`` of the same checkpoint from a local-disk root whose pages were evicted first
  (``echo 3 > /proc/sys/vm/drop_caches`` when root, else ``POSIX_FADV_DONTNEED`` on every file).

With ``--blocked``, it also launches two simulated nodes (two processes, gloo on 127.0.0.1, one memory directory
each) that ``save_async`` the state ``--saves`` times with replicas=1 and replicas=0 in turn, and reports the
median time each save blocked the loop and the bytes replicated.

    .venv/bin/python benchmarks/peer_replica.py --size 512MiB --reps 3 --disk /var/tmp/peer-bench --blocked
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def parse_size(text: str) -> int:
    from tiersave.units import parse_bytes

    return int(parse_bytes(text))


def state_of(nbytes: int) -> dict[str, Any]:
    import torch

    per = 64 << 20
    return {f"t{i}": torch.rand(min(per, nbytes - i * per) // 4) for i in range((nbytes + per - 1) // per)}


def socket_gbps(nbytes: int) -> float:
    """Loopback TCP: one connection, sendall from a thread, recv_into a buffer."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * 1)
    sink = memoryview(bytearray(4 << 20))
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            left = nbytes
            while left > 0:
                n = min(left, len(payload))
                s.sendall(payload[:n])
                left -= n

    thread = threading.Thread(target=send)
    start = time.perf_counter()
    thread.start()
    conn, _ = server.accept()
    got = 0
    with conn:
        while got < nbytes:
            n = conn.recv_into(sink)
            if n == 0:
                break
            got += n
    thread.join()
    seconds = time.perf_counter() - start
    server.close()
    return got / seconds / 1e9


def _serve(shm: Path, token: str) -> Any:
    from tiersave.replica import ReplicaServer
    from tiersave.storage.memory import MemoryStorage

    os.environ["TIERSAVE_SHM_DIR"] = str(shm / "peer")
    served = MemoryStorage("run")
    return ReplicaServer("127.0.0.1", token, 60, lambda ns: served, lambda n, s: None, node=0)


def _replacement(shm: Path) -> Any:
    from tiersave.storage.memory import MemoryStorage

    replacement = shm / "replacement"
    shutil.rmtree(replacement, ignore_errors=True)
    os.environ["TIERSAVE_SHM_DIR"] = str(replacement)
    return MemoryStorage("run")


def peer_restore_gbps(shm: Path, step: int, nbytes: int, token: str, into: Any = None) -> float:
    """A replacement node's restore as ``Checkpointer.restore`` does it after node loss: this rank's part
    streamed from the peer's replica server straight into new tensors (every chunk checked once, on arrival;
    one connection per chunk, the restore's reader threads in parallel). The node's memory copy is pulled
    afterwards in the background and is not timed."""
    from concurrent.futures import ThreadPoolExecutor

    from tiersave import knobs
    from tiersave.replica import PeerClient
    from tiersave.replica_read import read_from_holders
    from tiersave.restore import Restore

    server = _serve(shm, token)
    local = _replacement(shm)
    try:
        with ThreadPoolExecutor(knobs.io_threads()) as pool:
            clients = [PeerClient(server.address, token, 60)]
            start = time.perf_counter()
            read_from_holders(clients, "own", step, local, lambda c: Restore(c, into, True).run(pool))
            seconds = time.perf_counter() - start
    finally:
        server.close()
    return nbytes / seconds / 1e9


def pull_restore_gbps(shm: Path, step: int, nbytes: int, token: str, into: Any = None) -> float:
    """The earlier way, for comparison: pull the part into memory (``replica.fetch_part``: CRC of every chunk,
    one shard at a time), then restore from memory (CRC again)."""
    import tiersave
    from tiersave.replica import PeerClient, fetch_part

    server = _serve(shm, token)
    local = _replacement(shm)
    try:
        with tiersave.Checkpointer(tiers=[tiersave.Tier("mem://run")], event_log=False) as ckpt:
            start = time.perf_counter()
            fetch_part(PeerClient(server.address, token, 60), "own", local, step, {0})
            ckpt.restore(step, into=into)
            seconds = time.perf_counter() - start
    finally:
        server.close()
    return nbytes / seconds / 1e9


def disk_restore_gbps(disk: Path, step: int, nbytes: int, into: Any = None) -> tuple[float, str]:
    import tiersave
    from tiersave.bench.device import evict

    how = evict([disk])
    with tiersave.Checkpointer(disk, event_log=False) as ckpt:
        start = time.perf_counter()
        ckpt.restore(step, into=into)
        seconds = time.perf_counter() - start
    return nbytes / seconds / 1e9, how


def transfer(args: argparse.Namespace) -> dict[str, Any]:
    import tiersave
    from tiersave.drain import copy_checkpoint
    from tiersave.storage import open_storage

    nbytes = parse_size(args.size)
    shm = Path(tempfile.mkdtemp(prefix="peer-bench-", dir="/dev/shm"))
    os.chmod(shm, 0o700)
    disk = Path(args.disk)
    shutil.rmtree(disk, ignore_errors=True)
    try:
        (shm / "peer").mkdir(mode=0o700)
        os.environ["TIERSAVE_SHM_DIR"] = str(shm / "peer")
        with tiersave.Checkpointer(tiers=[tiersave.Tier("mem://run")], event_log=False) as ckpt:
            ckpt.save(1, state_of(nbytes))
            stored = ckpt.list()[-1].stored_bytes
        copy_checkpoint(open_storage("mem://run"), open_storage(str(disk)), 1)
        # --into: restore into a live state (its pages touched already, as a model built before its restore),
        # else into new tensors (whose pages fault in on first touch, the same for every source)
        live = state_of(nbytes) if args.into else None
        runs: dict[str, list[float]] = {"socket": [], "peer": [], "pull": [], "disk": []}
        how = ""
        order = list(runs)
        for rep in range(args.reps):
            for name in order[rep % len(order) :] + order[: rep % len(order)]:
                if name == "socket":
                    runs[name].append(socket_gbps(stored))
                elif name == "peer":
                    runs[name].append(peer_restore_gbps(shm, 1, stored, "bench-token", live))
                elif name == "pull":
                    runs[name].append(pull_restore_gbps(shm, 1, stored, "bench-token", live))
                else:
                    gbps, how = disk_restore_gbps(disk, 1, stored, live)
                    runs[name].append(gbps)
        med = {k: statistics.median(v) for k, v in runs.items()}
        return {
            "bytes": stored,
            "reps": args.reps,
            "destination": "live state" if args.into else "new tensors",
            "eviction": how,
            "gbps": {k: round(v, 3) for k, v in med.items()},
            "all_gbps": {k: [round(x, 3) for x in v] for k, v in runs.items()},
            "peer_over_disk": round(med["peer"] / med["disk"], 2),
            "peer_over_socket": round(med["peer"] / med["socket"], 2),
            "peer_over_pull": round(med["peer"] / med["pull"], 2),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def blocked(args: argparse.Namespace) -> dict[str, Any]:
    """Two simulated nodes save_async ``--saves`` times, replicas=1 and replicas=0 interleaved."""
    out: dict[str, list[float]] = {"1": [], "0": []}
    traffic: list[int] = []
    for rep in range(args.reps):
        for replicas in ("1", "0") if rep % 2 == 0 else ("0", "1"):
            with tempfile.TemporaryDirectory(prefix="peer-blocked-", dir="/dev/shm") as tmp:
                port = _free_port()
                procs = []
                for rank in range(2):
                    shm = Path(tmp) / f"node{rank}"
                    env = {
                        **os.environ,
                        "PYTHONPATH": str(ROOT / "src"),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                        "RANK": str(rank),
                        "WORLD_SIZE": "2",
                        "GROUP_RANK": str(rank),
                        "LOCAL_RANK": "0",
                        "TIERSAVE_SHM_DIR": str(shm),
                        "OMP_NUM_THREADS": "1",
                    }
                    argv = [sys.executable, __file__, "--rank-worker", replicas, "--size", args.size]
                    argv += ["--saves", str(args.saves), "--result", str(Path(tmp) / f"r{rank}.json")]
                    procs.append(subprocess.Popen(argv, env=env))
                for proc in procs:
                    proc.wait(timeout=600)
                results = [json.loads((Path(tmp) / f"r{rank}.json").read_text()) for rank in range(2)]
                out[replicas].append(statistics.median(results[0]["blocked_s"] + results[1]["blocked_s"]))
                if replicas == "1":
                    traffic.append(sum(r["replicated_bytes"] for r in results))
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "saves": args.saves,
        "blocked_s": {f"replicas={k}": round(v, 4) for k, v in med.items()},
        "all_blocked_s": {f"replicas={k}": [round(x, 4) for x in v] for k, v in out.items()},
        "ratio": round(med["1"] / med["0"], 3) if med["0"] > 0 else None,
        "replicated_bytes_per_run": traffic,
    }


def rank_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import tiersave

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = state_of(parse_size(args.size))
    tier = tiersave.Tier("mem://run", replicas=int(args.rank_worker), keep=2)
    blocked_s: list[float] = []
    replicated = 0
    with tiersave.Checkpointer(tiers=[tier], coordination_timeout_s=120, event_log=False) as ckpt:
        for step in range(1, args.saves + 1):
            handle = ckpt.save_async(step, state)
            blocked_s.append(handle.stats.blocked_s)
            for t in state.values():  # the training step: the state changes between saves
                t.add_(1)
            handle.result(300)
            if "memory.replica" in handle.tiers:
                handle.tier_result("memory.replica", 300)
                replicated += handle.stats.stored_bytes  # this node's part, sent to its one holder
    Path(args.result).write_text(json.dumps({"rank": rank, "blocked_s": blocked_s, "replicated_bytes": replicated}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--disk", default="/var/tmp/tiersave-peer-bench")
    parser.add_argument("--blocked", action="store_true")
    parser.add_argument("--into", action="store_true", help="restore into a live state instead of new tensors")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker is not None:
        rank_worker(args)
        return
    report: dict[str, Any] = {"transfer": transfer(args)}
    if args.blocked:
        report["blocked"] = blocked(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
