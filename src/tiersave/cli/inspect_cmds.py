"""``tiersave ls``, ``inspect`` and ``verify``: look at checkpoints without torch."""

from __future__ import annotations

import argparse
import math
from typing import Any

from ..errors import CheckpointNotFoundError
from ..format.manifest import Manifest
from ..units import human_bytes, table
from ._common import EXIT_FAILURE, EXIT_OK, ByteProgress, Output, add_json_flag
from .tag_cmd import describe_tags


def register(sub: Any) -> None:
    p = sub.add_parser(
        "ls",
        help="list the checkpoints under one or more roots (tiers)",
        description="List committed checkpoints and leftovers of interrupted saves. With several roots (the "
        "tiers of one run, fastest first), show which tiers hold which step. Exit code 1 if nothing is committed.",
    )
    p.add_argument("root", nargs="+", help="checkpoint root: a path, file://, mem://NAME or s3://bucket/prefix")
    add_json_flag(p)
    p.set_defaults(handler=_ls)

    p = sub.add_parser(
        "inspect",
        help="show one checkpoint's tensors, metadata and metrics",
        description="Show a checkpoint's manifest: state tree, tensors, metrics, tags, stats.",
    )
    p.add_argument("root")
    p.add_argument("--step", type=int, help="step to inspect (default: the newest)")
    p.add_argument("--tag", help="inspect the step a movable tag points to (else the newest with this manifest tag)")
    p.add_argument("--max-tensors", type=int, default=50, help="tensors to list in text output (default 50)")
    add_json_flag(p)
    p.set_defaults(handler=_inspect)

    p = sub.add_parser(
        "verify",
        help="read every byte and check it against the checksums",
        description="Verify checkpoints: every tensor chunk against its CRC-32C, shard sizes, "
        "zero padding. Exit code 1 if any checkpoint is damaged.",
    )
    p.add_argument("root")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="step to verify (default: the newest)")
    g.add_argument("--all", action="store_true", help="verify every checkpoint")
    add_json_flag(p)
    p.set_defaults(handler=_verify)


def _catalog(root: str) -> Any:
    from ..catalog import Catalog
    from ..storage import open_storage

    return Catalog(open_storage(root, create=False))


def _ls(args: argparse.Namespace, out: Output) -> int:
    from ..tierspec import default_name

    catalogs = [_catalog(root) for root in args.root]
    names = [default_name(root, c.storage) for root, c in zip(args.root, catalogs)]
    if len(set(names)) != len(names):
        names = [f"{n}{i}" for i, n in enumerate(names)]
    held: dict[int, list[str]] = {}
    infos: dict[int, Any] = {}
    errors: dict[int, str] = {}
    for name, catalog in zip(names, catalogs):
        for step, info, err in catalog.entries():
            held.setdefault(step, []).append(name)
            if info is not None and step not in infos:
                infos[step] = info
            elif info is None:
                errors.setdefault(step, f"{name}: {err}")
    rows, items = [], []
    for step in sorted(held):
        tiers = ",".join(held[step])
        info = infos.get(step)
        if info is None:
            items.append({"step": step, "tiers": held[step], "error": errors.get(step, "")})
            rows.append([str(step), tiers, "-", "-", "-", "-", f"UNREADABLE: {errors.get(step, '')}"])
            continue
        items.append({**info.to_json(), "tiers": held[step]})
        metrics = " ".join(f"{k}={v:.6g}" for k, v in sorted(info.metrics.items()))
        rows.append(
            [
                str(step),
                tiers,
                info.created_at.replace("T", " ")[:19],
                human_bytes(info.stored_bytes),
                str(info.num_tensors),
                ",".join(info.tags) or "-",
                metrics or "-",
            ]
        )
    leftovers = [{"root": c.storage.uri, "name": n, "status": s} for c in catalogs for n, s in c.leftovers()]
    damaged = [{"root": c.storage.uri, "name": n} for c in catalogs for n in c.damaged()]
    headers = ["step", "tiers", "created (UTC)", "size", "tensors", "tags", "metrics"]
    if len(catalogs) == 1:  # one root: no tiers column
        headers.pop(1)
        rows = [r[:1] + r[2:] for r in rows]
    where = ", ".join(c.storage.uri for c in catalogs)
    text = table(headers, rows) if rows else f"no committed checkpoint in {where} (exit code 1)"
    if leftovers:
        text += "\n\nleftovers (removed by `tiersave prune`):\n" + "\n".join(
            f"  {x['root']}: {x['name']}  ({x['status']})" for x in leftovers
        )
    if damaged:
        text += "\n\ndamaged (a step directory without manifest.json: not a checkpoint; nothing removes it):\n"
        text += "\n".join(f"  {x['root']}: {x['name']}" for x in damaged)
    readers = [
        {"root": c.storage.uri, "step": step, "leases": n}
        for c in catalogs
        for step, n in sorted(c.leases.leased().items())
    ]
    if readers:
        text += "\n\nread now by other processes (live read leases; retention keeps these steps):\n"
        text += "\n".join(f"  {x['root']}: step {x['step']}  ({x['leases']} reader(s))" for x in readers)
    doc: dict[str, Any] = {"checkpoints": items, "leftovers": leftovers, "damaged": damaged, "readers": readers}
    held_here = _replicas_held(catalogs[0].storage) if len(catalogs) == 1 else {}
    if held_here:
        doc["replicas"] = {str(node): steps for node, steps in held_here.items()}
        text += "\n\npeer replicas held on this node (tiersave ls mem://replicas/NAME/node-N):\n"
        text += "\n".join(
            f"  node {node}: steps {', '.join(map(str, steps)) or '-'}" for node, steps in held_here.items()
        )
    if len(catalogs) == 1:
        doc["root"] = catalogs[0].storage.uri
    else:
        doc["roots"] = [{"name": n, "uri": c.storage.uri} for n, c in zip(names, catalogs)]
    doc["tags"] = [{"root": c.storage.uri, **item} for c in catalogs for item in describe_tags(c)[0]]
    if doc["tags"]:
        text += "\n\nmovable tags (tiersave tag):\n" + "\n".join(
            f"  {x['root']}: {x['name']} -> " + (f"step {x['step']}" if "error" not in x else f"BROKEN: {x['error']}")
            for x in doc["tags"]
        )
    out.emit(doc, text)
    return EXIT_OK if held else EXIT_FAILURE  # nothing committed: a typo in the root, or a run that never saved


def _replicas_held(storage: Any) -> dict[int, list[int]]:
    """For a memory tier: the committed steps of each other node's part that this node holds as a replica."""
    from ..catalog import Catalog
    from ..storage.memory import MemoryStorage, shm_base

    if not isinstance(storage, MemoryStorage):
        return {}
    base = shm_base().joinpath("replicas", *storage.name.split("/"))
    nodes = sorted(int(p.name[5:]) for p in base.glob("node-*") if p.name[5:].isdigit()) if base.is_dir() else []
    return {n: Catalog(MemoryStorage(f"replicas/{storage.name}/node-{n}", create=False)).steps() for n in nodes}


def _pick_step(catalog: Any, step: int | None, tag: str | None) -> int:
    return int(catalog.find(step, tag)[0])


class _SummaryHooks:
    """Decodes a manifest tree into a JSON-able summary (tensors described, not loaded)."""

    def __init__(self, manifest: Any) -> None:
        self.m = manifest

    def _t(self, name: str, kind: str) -> Any:
        t = self.m.tensors[name]
        return {kind: name, "dtype": t.dtype, "shape": list(t.shape)}

    def tensor(self, name: str, path: str) -> Any:
        return self._t(name, "tensor")

    def ndarray(self, name: str, path: str) -> Any:
        return self._t(name, "ndarray")

    def npscalar(self, dtype: str, raw: bytes, path: str) -> Any:
        return {"numpy_scalar": dtype, "hex": raw.hex()}

    def dtype(self, name: str, path: str) -> Any:
        return {"dtype": name}

    def stateful(self, type_name: str, state: Any, path: str) -> Any:
        return {"object": type_name, "state": state}

    def statedict(self, entries: dict[Any, Any], metadata: Any, path: str) -> Any:
        return entries


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return {"bytes": len(value)}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _render(value: Any, indent: int = 0, limit: list[int] | None = None) -> list[str]:
    limit = limit if limit is not None else [200]
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(value, dict) and ("tensor" in value or "ndarray" in value) and "shape" in value:
        return [f"{pad}{value['dtype']}{value['shape']}"]
    if isinstance(value, dict):
        for k, v in value.items():
            if limit[0] <= 0:
                lines.append(f"{pad}...")
                break
            limit[0] -= 1
            if isinstance(v, (dict, list)) and not ("shape" in v if isinstance(v, dict) else False) and v:
                lines.append(f"{pad}{k}:")
                lines.extend(_render(v, indent + 1, limit))
            else:
                lines.append(f"{pad}{k}: {_render(v, 0, limit)[0].strip() if v != {} else '{}'}")
        return lines
    if isinstance(value, list):
        if len(value) > 8 and all(not isinstance(v, (dict, list)) for v in value):
            return [f"{pad}[{', '.join(map(str, value[:8]))}, ... ({len(value)} items)]"]
        for i, v in enumerate(value):
            if limit[0] <= 0:
                lines.append(f"{pad}...")
                break
            limit[0] -= 1
            sub = _render(v, indent + 1, limit)
            lines.append(f"{pad}- {sub[0].strip()}" if len(sub) == 1 else f"{pad}- [{i}]")
            if len(sub) > 1:
                lines.extend(sub)
        return lines or [f"{pad}[]"]
    return [f"{pad}{value!r}"]


def _increment_line(m: Manifest) -> list[str]:
    """Bytes this save wrote vs referenced from earlier steps (incremental saves only)."""
    if not any(s.content for s in m.shards):
        return []
    steps = ", ".join(map(str, sorted(m.referenced_steps))) or "-"
    compared = _compared_bytes(m)
    return [
        f"  incremental: {human_bytes(m.stored_bytes - m.referenced_bytes)} written, "
        f"{human_bytes(m.referenced_bytes)} referenced (held by step {steps}); pieces hashed with {m.content_hash}"
        + (f", {human_bytes(compared)} found unchanged in memory instead" if compared else "")
    ]


def _compared_bytes(m: Manifest) -> int | None:
    """Bytes the save found equal to its base's by comparing them in the staging memory (never hashed): the
    ``compared_bytes`` of its statistics (the first rank's, for many ranks); None if it did not say."""
    value = m.stats.get("compared_bytes")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _compression_line(m: Manifest) -> list[str]:
    """Bytes stored on this tier vs decoded, for a checkpoint with compressed shards."""
    if not any(s.encoding is not None for s in m.shards):
        return []
    codecs = ", ".join(sorted({s.encoding.codec for s in m.shards if s.encoding is not None}))
    return [
        f"  compressed ({codecs}): {human_bytes(m.file_bytes)} stored for {human_bytes(m.stored_bytes)} decoded, "
        f"ratio {m.stored_bytes / max(1, m.file_bytes):.3f}"
    ]


def _inspect(args: argparse.Namespace, out: Output) -> int:
    from ..format.tree import TreeDecoder

    catalog = _catalog(args.root)
    step = _pick_step(catalog, args.step, args.tag)
    m = catalog.manifest(step)
    tree = _jsonable(TreeDecoder(_SummaryHooks(m)).decode(m.tree))
    tensors = [
        {
            "name": t.name,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "nbytes": t.nbytes,
            "shard": m.shards[t.shard].file,
            "offset": t.offset,
        }
        for t in m.tensors.values()
    ]
    data = {
        "step": m.step,
        "location": catalog.location(step),
        "format_version": m.format_version,
        "created_at": m.created_at,
        "world_size": m.world_size,
        "tags": list(catalog.info(step).tags),  # the manifest's, then the movable tags pointing here
        "metrics": dict(m.metrics),
        "metadata": dict(m.metadata),
        "stats": dict(m.stats),
        "tensor_bytes": m.total_bytes,
        "stored_bytes": m.stored_bytes,
        "written_bytes": m.stored_bytes - m.referenced_bytes,
        "referenced_bytes": m.referenced_bytes,
        "referenced_steps": sorted(m.referenced_steps),
        "compared_bytes": _compared_bytes(m),
        "content_hash": m.content_hash if any(s.content for s in m.shards) else None,
        "file_bytes": m.file_bytes,
        "compression_ratio": round(m.stored_bytes / max(1, m.file_bytes), 4),
        "shards": [s.to_json() for s in m.shards],
        "tensors": tensors,
        "tree": tree,
    }
    lines = [
        f"step {m.step}  ({catalog.location(step)})",
        f"  created {m.created_at}   format {m.format_version}   world size {m.world_size}",
        f"  {len(tensors)} tensors, {human_bytes(m.total_bytes)} of data, {human_bytes(m.stored_bytes)} "
        f"in {len(m.shards)} shard(s)",
        *_increment_line(m),
        *_compression_line(m),
        f"  tags: {', '.join(m.tags) or '-'}",
        f"  metrics: {', '.join(f'{k}={v:.6g}' for k, v in m.metrics.items()) or '-'}",
    ]
    if m.metadata:
        lines.append(f"  metadata: {_jsonable(dict(m.metadata))}")
    if m.stats:
        lines.append("  save stats: " + ", ".join(f"{k}={v}" for k, v in m.stats.items()))
    lines.append("\nstate:")
    lines.extend(_render(tree, 1))
    lines.append("\ntensors:")
    rows = [[t["name"], t["dtype"], str(t["shape"]), human_bytes(t["nbytes"])] for t in tensors[: args.max_tensors]]
    lines.append(table(["name", "dtype", "shape", "size"], rows))
    if len(tensors) > args.max_tensors:
        lines.append(f"... and {len(tensors) - args.max_tensors} more (--max-tensors, or --json)")
    out.emit(data, "\n".join(lines))
    return EXIT_OK


def _verify(args: argparse.Namespace, out: Output) -> int:
    catalog = _catalog(args.root)
    chosen = catalog.steps() if args.all else catalog.find(args.step)[:1]
    if not chosen:
        raise CheckpointNotFoundError(f"no committed checkpoint in {args.root}: nothing to verify")
    reports = []
    for step in chosen:
        out.progress(f"verifying step {step} ...")
        bar = ByteProgress(out, f"step {step}")
        try:
            reports.append(catalog.verify(step, progress=bar.update))
        finally:
            bar.close()
    lines = []
    for r in reports:
        rate = r.bytes_checked / r.seconds / 1e9 if r.seconds > 0 else 0.0
        status = "OK" if r.ok else "DAMAGED"
        lines.append(f"step {r.step}: {status}  {human_bytes(r.bytes_checked)} in {r.seconds:.2f} s ({rate:.2f} GB/s)")
        lines.extend(f"    {e}" for e in r.errors)
        lines.extend(f"    note: {n}" for n in r.notes)
    ok = all(r.ok for r in reports)
    out.emit({"ok": ok, "reports": [r.to_json() for r in reports]}, "\n".join(lines))
    return EXIT_OK if ok else EXIT_FAILURE
