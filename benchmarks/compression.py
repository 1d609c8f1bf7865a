"""Issue 13's compression question, measured before building it (docs/format.md section 10, planned): zstd
ratio and single-thread throughput per component of a training state, with and without a byte-plane split.

Components (``--mb`` each): bf16 weights, fp32 master weights, fp32 Adam ``exp_avg`` and ``exp_avg_sq``.
Their values are synthetic (normal weights of std 0.02, first moments of std 1e-4, second moments the square
of a normal of std 1e-3): real trained tensors differ, but what the split exploits, exponents concentrated on a
few values, holds for any such distribution. The byte-plane split writes byte 0 of every element, then byte 1,
and so on (little-endian: the last plane holds the sign and the high exponent bits). Each cell is the median of
``--reps`` runs; throughput counts the input bytes (split included in compression time, unsplit in
decompression time).

Usage::

    .venv/bin/python benchmarks/compression.py --mb 64 --reps 3 --json benchmarks/results/compression.json
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 3])
    p.add_argument("--json", type=Path)
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
    if args.json:
        args.json.write_text(json.dumps({"mb": args.mb, "reps": args.reps, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
