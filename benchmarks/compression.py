"""Issue 13's compression: zstd ratio and single-thread throughput per component of a training state, with
and without a byte-plane split, and (``--e2e-mb``) the end-to-end time of a drain to an S3 tier with and
without ``compress="zstd"`` (docs/format.md section 10, docs/tiers.md "Compression").

Components (``--mb`` each): bf16 weights, fp32 master weights, fp32 Adam ``exp_avg`` and ``exp_avg_sq``.
Their values are synthetic (normal weights of std 0.02, first moments of std 1e-4, second moments the square
of a normal of std 1e-3): real trained tensors differ, but what the split exploits, exponents concentrated on a
few values, holds for any such distribution. The byte-plane split writes byte 0 of every element, then byte 1,
and so on (little-endian: the last plane holds the sign and the high exponent bits). Each cell is the median of
``--reps`` runs; throughput counts the input bytes (split included in compression time, unsplit in
decompression time).

The ``tiersave`` rows time the library's own frame encoder (``tiersave.engine.codec.encode_frame``: split,
zstd-1, CRC-32C of the stored bytes) on one 16 MiB checksum chunk at a time, what a drain thread does.

The end-to-end part saves a state of ``--e2e-mb`` MiB (bf16 weights, fp32 ``exp_avg`` and ``exp_avg_sq`` in
the proportions 1:2:2) to a local root, then copies it to a bucket of a SeaweedFS S3 server started on this
machine (``tiersave.testing.seaweed``) with ``copy_checkpoint(..., compress=None)`` and ``"zstd"``,
interleaved, ``--reps`` times each, and reports the median seconds and bytes sent.

Usage::

    .venv/bin/python benchmarks/compression.py --mb 64 --reps 3 --e2e-mb 512 --json benchmarks/results/compression.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

MiB = 1 << 20


def components(mb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n32 = mb * MiB // 4
    n16 = mb * MiB // 2
    return {
        "bf16 weights": (torch.randn(n16, generator=g) * 0.02).to(torch.bfloat16),
        "fp32 master weights": torch.randn(n32, generator=g) * 0.02,
        "fp32 exp_avg": torch.randn(n32, generator=g) * 1e-4,
        "fp32 exp_avg_sq": (torch.randn(n32, generator=g) * 1e-3) ** 2,
    }


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def split(data: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(data.reshape(-1, width).T).reshape(-1)


def unsplit(data: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(data.reshape(width, -1).T).reshape(-1)


def measure(data: np.ndarray, width: int, planes: bool, level: int) -> tuple[float, float, float]:
    """(ratio, compress GB/s, decompress GB/s) for one buffer, round trip checked."""
    cctx = zstandard.ZstdCompressor(level=level)
    dctx = zstandard.ZstdDecompressor()
    t0 = time.perf_counter()
    src = split(data, width) if planes else data
    packed = cctx.compress(src.tobytes())
    t1 = time.perf_counter()
    out = np.frombuffer(dctx.decompress(packed), dtype=np.uint8)
    if planes:
        out = unsplit(out, width)
    t2 = time.perf_counter()
    if not np.array_equal(out, data):
        raise AssertionError("round trip changed the bytes")
    return data.nbytes / len(packed), data.nbytes / (t1 - t0) / 1e9, data.nbytes / (t2 - t1) / 1e9


def measure_codec(data: np.ndarray, width: int) -> tuple[float, float]:
    """(ratio, GB/s) of tiersave's frame encoder over ``data`` in 16 MiB frames."""
    from tiersave.engine.codec import encode_frame

    view = memoryview(data.tobytes())
    stored = 0
    t0 = time.perf_counter()
    for off in range(0, len(view), 16 * MiB):
        packed, _ = encode_frame(view[off : off + 16 * MiB], width)
        stored += len(packed)
    return len(view) / stored, len(view) / (time.perf_counter() - t0) / 1e9


def end_to_end(mb: int, reps: int, threads: int) -> list[dict[str, object]]:
    """Median seconds of a drain to a SeaweedFS S3 tier, plain and zstd, interleaved."""
    import tempfile

    import tiersave
    from tiersave.drain import copy_checkpoint
    from tiersave.storage.posix import LocalStorage
    from tiersave.testing.seaweed import SeaweedServer

    g = torch.Generator().manual_seed(1)
    unit = mb * MiB // 5
    state = {
        "weights": (torch.randn(unit // 2, generator=g) * 0.02).to(torch.bfloat16),
        "exp_avg": torch.randn(2 * unit // 4, generator=g) * 1e-4,
        "exp_avg_sq": (torch.randn(2 * unit // 4, generator=g) * 1e-3) ** 2,
    }
    server = SeaweedServer.shared()
    runs: dict[str | None, list[tuple[float, int, int]]] = {None: [], "zstd": []}
    with tempfile.TemporaryDirectory() as tmp:
        with tiersave.Checkpointer(tmp, chunk_bytes=16 * MiB) as ckpt:
            ckpt.save(1, state).result()
        src = LocalStorage(tmp)
        for rep in range(reps):
            for compress in (None, "zstd"):
                dst = server.storage(f"bench-{rep}-{compress or 'plain'}-{time.time_ns()}", "run")
                try:
                    r = copy_checkpoint(src, dst, 1, compress=compress, io_threads=threads)
                finally:
                    dst.close()
                runs[compress].append((r.seconds, r.file_bytes, r.tensor_bytes))
    rows = []
    for compress, items in runs.items():
        seconds = statistics.median(s for s, _, _ in items)
        rows.append(
            {"compress": compress, "seconds": seconds, "sent_bytes": items[0][1], "tensor_bytes": items[0][2],
             "all_seconds": [s for s, _, _ in items]}
        )  # fmt: skip
        print(
            f"drain {mb} MiB to S3 (SeaweedFS), compress={compress!s:<5} median {seconds:6.2f} s "
            f"of {[round(s, 2) for s, _, _ in items]}, sent {items[0][1] / MiB:7.1f} MiB"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 3])
    p.add_argument("--json", type=Path)
    p.add_argument("--e2e-mb", type=int, default=0, help="also time a drain of this many MiB to S3 (0: skip)")
    p.add_argument("--threads", type=int, default=2, help="drain threads for --e2e-mb")
    args = p.parse_args()
    rows = []
    for name, tensor in components(args.mb).items():
        data, width = raw_bytes(tensor), tensor.element_size()
        for level in args.levels:
            for planes in (False, True):
                runs = [measure(data, width, planes, level) for _ in range(args.reps)]
                ratio, comp, decomp = (statistics.median(r[i] for r in runs) for i in range(3))
                rows.append(
                    {"component": name, "level": level, "byte_planes": planes, "ratio": ratio,
                     "compress_gbps": comp, "decompress_gbps": decomp}
                )  # fmt: skip
                print(
                    f"{name:<20} zstd-{level} {'planes' if planes else 'plain ':<6}  ratio {ratio:5.3f}  "
                    f"compress {comp:5.2f} GB/s  decompress {decomp:5.2f} GB/s"
                )
        for planes in (False, True):
            runs2 = [measure_codec(data, width if planes else 1) for _ in range(args.reps)]
            ratio, comp = (statistics.median(r[i] for r in runs2) for i in range(2))
            rows.append({"component": name, "level": "tiersave", "byte_planes": planes, "ratio": ratio,
                         "compress_gbps": comp})  # fmt: skip
            kind = "planes" if planes else "plain "
            print(f"{name:<20} tiersave {kind}  ratio {ratio:5.3f}  encode {comp:5.2f} GB/s")
    e2e = end_to_end(args.e2e_mb, args.reps, args.threads) if args.e2e_mb else []
    if args.json:
        doc = {"mb": args.mb, "reps": args.reps, "rows": rows, "end_to_end": e2e}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
