"""What a manifest of 10^4-10^6 tensors costs: its size, the time to parse and validate it (what every restore,
``ls`` and retention pays) and to serialize it (the commit thread), and the memory a parse takes.

The manifests are built, not saved: each tensor gets a realistic mixture-of-experts name
(``model.layers.L.mlp.experts.E.gate_proj.weight`` and the optimizer's ``exp_avg`` / ``exp_avg_sq``), one
shard, a bfloat16 shape, an offset, a size and one CRC, and the tree maps each name to its tensor, exactly
as a save writes them. The format caps a manifest at 64 MiB (``MAX_MANIFEST_BYTES``); past that this script
lifts the cap for the measurement only, to show what the JSON itself costs, and says which sizes a real
save or restore would refuse.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/manifest_scale.py --counts 10000 100000 300000 1000000 --runs 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from typing import Any

from tiersave.format import manifest as manifest_mod
from tiersave.format.layout import MAX_MANIFEST_BYTES
from tiersave.format.manifest import Manifest, seal

_PROJ = ("gate_proj", "up_proj", "down_proj")
_KIND = ("weight", "exp_avg", "exp_avg_sq")


def names(count: int) -> list[str]:
    """MoE-like tensor names: 128 experts x 3 projections x (weight, 2 Adam moments) per layer."""
    out = []
    for i in range(count):
        kind, rest = _KIND[i % 3], i // 3
        proj, rest = _PROJ[rest % 3], rest // 3
        expert, layer = rest % 128, rest // 128
        prefix = "model" if kind == "weight" else "optim.state"
        out.append(f"{prefix}.layers.{layer}.mlp.experts.{expert}.{proj}.{kind}")
    return out


def document(count: int) -> dict[str, Any]:
    """The manifest document of a one-shard checkpoint of ``count`` bfloat16 tensors of 2 KiB."""
    tensors = {}
    tree = {}
    for i, name in enumerate(names(count)):
        tensors[name] = {
            "dtype": "bfloat16",
            "shape": [1024],
            "shard": 0,
            "offset": i * 4096,
            "nbytes": 2048,
            "crc32c": [f"{(i * 2654435761) & 0xFFFFFFFF:08x}"],
        }
        tree[name] = {"$tensor": name}
    return {
        "format": "tiersave",
        "format_version": "1.1",
        "step": 1,
        "created_at": "2026-11-23T00:00:00.000000Z",
        "world_size": 1,
        "library": {"name": "tiersave", "version": "0.1.0"},
        "checksum": {"algorithm": "crc32c", "chunk_bytes": 64 << 20},
        "shards": [{"file": "shard-00000-000.bin", "rank": 0, "size": count * 4096}],
        "tensors": tensors,
        "tree": tree,
        "metrics": {},
        "tags": [],
        "metadata": {},
        "stats": {},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", type=int, nargs="*", default=[10_000, 100_000, 300_000, 1_000_000])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    # Lift the cap for the measurement (the module reads it at call time); the report says what it refuses.
    manifest_mod.MAX_MANIFEST_BYTES = 1 << 40  # type: ignore[attr-defined]
    rows = []
    for count in args.counts:
        data = seal(document(count))
        parse_s, dump_s = [], []
        m: Manifest | None = None
        for _ in range(args.runs):
            gc.collect()
            t0 = time.perf_counter()
            m = Manifest.parse(data, path="manifest.json")
            parse_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m.to_json()
            dump_s.append(time.perf_counter() - t0)
        del m
        gc.collect()
        tracemalloc.start()
        kept = Manifest.parse(data, path="manifest.json")
        retained, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del kept
        row = {
            "tensors": count,
            "bytes": len(data),
            "bytes_per_tensor": len(data) / count,
            "parse_s": statistics.median(parse_s),
            "to_json_s": statistics.median(dump_s),
            "parse_peak_bytes": peak,
            "retained_bytes": retained,
            "over_cap": len(data) > MAX_MANIFEST_BYTES,
        }
        rows.append(row)
        print(
            f"{count:>9,} tensors: {len(data) / 2**20:7.1f} MiB ({row['bytes_per_tensor']:.0f} B each)"
            f"{'  OVER THE 64 MiB CAP' if row['over_cap'] else ''}; parse {row['parse_s'] * 1e3:8.1f} ms "
            f"({row['parse_s'] / count * 1e6:.2f} us each), to_json {row['to_json_s'] * 1e3:8.1f} ms; "
            f"parse peak {peak / 2**20:7.1f} MiB, kept {retained / 2**20:7.1f} MiB "
            f"({retained / count:.0f} B each); runs {', '.join(f'{x * 1e3:.0f}' for x in parse_s)} ms",
            flush=True,
        )
        del data
    cap_tensors = int(MAX_MANIFEST_BYTES / (rows[-1]["bytes_per_tensor"] if rows else 1))
    print(f"the 64 MiB cap holds about {cap_tensors:,} tensors named like these")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
