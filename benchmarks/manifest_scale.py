"""What a manifest of 10^4-10^6 tensors costs: its size, the time to parse and validate it (what every restore,
``ls`` and retention pays) and to serialize it (the commit thread), and the memory a parse takes, in either
encoding of the tensor table: ``--encoding entries`` (one JSON object per tensor, formats 1.x-3.x) or
``--encoding compact`` (columns and tensor runs in the tree, docs/format.md 4.4: format 4.0, or 5.0 where the
writer knows the optimizer's ``$dict`` as one ``$dictruns`` node; the output names the version written).

The manifests are built, not saved, laid out as a save lays out a mixture-of-experts state: the model's
weights first (``model.layers.L.mlp.experts.E.gate_proj.weight``, 128 experts x 3 projections per layer),
then the optimizer's two Adam moments of each (``optim.state.I.exp_avg`` / ``exp_avg_sq``, the state under
integer keys as torch's optimizers hold it), each tensor a bfloat16 of 1024 elements in one shard with one
CRC. The format caps a manifest at 64 MiB (``MAX_MANIFEST_BYTES``); past that this script lifts the cap for
the measurement only, to show what the encoding itself costs, and says which sizes a real save or restore
would refuse.

``--encoding entries`` runs on a tiersave without the compact encoding too, so the same command compares
a tree before it (``PYTHONPATH=/path/to/old/src``) with this one, in alternating processes.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/manifest_scale.py --counts 10000 100000 1000000 --runs 3 \
        --encoding compact
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


def layout(count: int) -> tuple[list[str], Any]:
    """Tensor names in the order a save lists them, and the state tree naming them: ``count // 3`` expert
    weights (the rest of ``count``, 0-2, extra weights), then two Adam moments per weight."""
    params = count - 2 * (count // 3)
    keys = []
    for i in range(params):
        proj, rest = _PROJ[i % 3], i // 3
        keys.append(f"layers.{rest // 128}.mlp.experts.{rest % 128}.{proj}.weight")
    names = [f"model.{k}" for k in keys]
    pairs = []
    for i in range(count // 3):
        moments = {m: {"$tensor": f"optim.state.{i}.{m}"} for m in ("exp_avg", "exp_avg_sq")}
        names += [f"optim.state.{i}.exp_avg", f"optim.state.{i}.exp_avg_sq"]
        pairs.append([i, moments])
    model = {k: {"$tensor": f"model.{k}"} for k in keys}
    tree = {"model": model, "optim": {"state": {"$dict": pairs}, "param_groups": [{"lr": 1e-4, "params": []}]}}
    return names, tree


def document(count: int) -> dict[str, Any]:
    """The manifest document (per-entry encoding) of a one-shard checkpoint of ``count`` bfloat16 tensors
    of 2 KiB."""
    names, tree = layout(count)
    tensors = {}
    for i, name in enumerate(names):
        tensors[name] = {
            "dtype": "bfloat16",
            "shape": [1024],
            "shard": 0,
            "offset": i * 4096,
            "nbytes": 2048,
            "crc32c": [f"{(i * 2654435761) & 0xFFFFFFFF:08x}"],
        }
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


def encoded(count: int, encoding: str) -> bytes:
    """The sealed manifest of ``count`` tensors in ``encoding``."""
    if encoding == "entries":
        return seal(document(count))
    # absent before format 4.0: imported only here
    from tiersave.format import compact
    from tiersave.format.manifest import ShardInfo, TensorEntry

    compact.COMPACT_MIN_TENSORS = 1
    names, tree = layout(count)
    crcs = [(f"{(i * 2654435761) & 0xFFFFFFFF:08x}",) for i in range(count)]
    tensors = {n: TensorEntry(n, "bfloat16", (1024,), 0, i * 4096, 2048, crcs[i]) for i, n in enumerate(names)}
    shard = ShardInfo("shard-00000-000.bin", 0, count * 4096)
    m = Manifest(1, (shard,), tensors, tree, created_at="2026-11-23T00:00:00.000000Z")
    return m.to_json()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", type=int, nargs="*", default=[10_000, 100_000, 300_000, 1_000_000])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--encoding", choices=("entries", "compact"), default="compact", help="the table's encoding")
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    # Lift the cap for the measurement (the module reads it at call time); the report says what it refuses.
    manifest_mod.MAX_MANIFEST_BYTES = 1 << 40  # type: ignore[attr-defined]
    rows = []
    for count in args.counts:
        data = encoded(count, args.encoding)
        parse_s, dump_s, parse_cpu, dump_cpu = [], [], [], []
        m: Manifest | None = None
        for _ in range(args.runs):
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            m = Manifest.parse(data, path="manifest.json")
            parse_s.append(time.perf_counter() - t0)
            parse_cpu.append(time.process_time() - c0)
            t0, c0 = time.perf_counter(), time.process_time()
            m.to_json()
            dump_s.append(time.perf_counter() - t0)
            dump_cpu.append(time.process_time() - c0)
        del m
        gc.collect()
        tracemalloc.start()
        kept = Manifest.parse(data, path="manifest.json")
        retained, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del kept
        row = {
            "encoding": args.encoding,
            "format_version": json.loads(data[: data.index(b',"step"')] + b"}")["format_version"],
            "tensors": count,
            "bytes": len(data),
            "bytes_per_tensor": len(data) / count,
            "parse_s": statistics.median(parse_s),
            "to_json_s": statistics.median(dump_s),
            "parse_cpu_s": statistics.median(parse_cpu),  # CPU time: on a shared machine, the work itself
            "to_json_cpu_s": statistics.median(dump_cpu),
            "parse_peak_bytes": peak,
            "retained_bytes": retained,
            "over_cap": len(data) > MAX_MANIFEST_BYTES,
        }
        rows.append(row)
        print(
            f"{args.encoding:>7} {row['format_version']} {count:>9,} tensors: {len(data) / 2**20:7.1f} MiB "
            f"({row['bytes_per_tensor']:.0f} B each)"
            f"{'  OVER THE 64 MiB CAP' if row['over_cap'] else ''}; parse {row['parse_s'] * 1e3:8.1f} ms "
            f"({row['parse_s'] / count * 1e6:.2f} us each; CPU {row['parse_cpu_s'] * 1e3:.0f} ms), "
            f"to_json {row['to_json_s'] * 1e3:8.1f} ms (CPU {row['to_json_cpu_s'] * 1e3:.0f} ms); "
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
