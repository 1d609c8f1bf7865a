"""``tiersave export``: write a checkpoint's tensors as a safetensors file."""

from __future__ import annotations

import argparse
from typing import Any

from ..units import human_bytes
from ._common import EXIT_OK, ByteProgress, Output, add_json_flag


def register(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="export a checkpoint's tensors to safetensors",
        description="Export tensors of one checkpoint to a .safetensors file (checksums verified on the way). "
        "Example: tiersave export ckpts --step 1000 --prefix model. --to model.safetensors",
    )
    p.add_argument("root")
    p.add_argument("--step", type=int, help="step to export (default: the newest)")
    p.add_argument("--tag", help="export the newest checkpoint with this tag")
    p.add_argument("--to", required=True, dest="dest", help="output .safetensors file")
    p.add_argument("--prefix", default="", help="only tensors whose names start with this; the prefix is stripped")
    p.add_argument(
        "--skip-unsupported",
        action="store_true",
        help="leave out tensors whose dtype safetensors cannot store instead of failing",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    add_json_flag(p)
    p.set_defaults(handler=_export)


def _export(args: argparse.Namespace, out: Output) -> int:
    from ..catalog import Catalog
    from ..export import export_safetensors
    from ..storage import open_storage

    catalog = Catalog(open_storage(args.root, create=False))
    step = catalog.find(args.step, args.tag)[0]
    if _is_dcp(catalog, step):
        return _export_dcp(args, out, step)
    bar = ByteProgress(out, f"step {step}")
    try:
        result = export_safetensors(
            catalog,
            step,
            args.dest,
            prefix=args.prefix,
            skip_unsupported=args.skip_unsupported,
            overwrite=args.force,
            progress=bar.update,
        )
    finally:
        bar.close()
    text = f"exported {result.tensors} tensors ({human_bytes(result.bytes)}) of step {step} to {result.path}"
    if result.skipped:
        text += (
            f"\nskipped {len(result.skipped)} tensor(s) with dtypes safetensors lacks: {', '.join(result.skipped[:5])}"
        )
    out.emit(
        {
            "path": result.path,
            "step": step,
            "tensors": result.tensors,
            "bytes": result.bytes,
            "skipped": result.skipped,
        },
        text,
    )
    return EXIT_OK


def _is_dcp(catalog: Any, step: int) -> bool:
    """Whether ``step`` was saved through ``torch.distributed.checkpoint`` with ``tiersave.dcp.Writer``."""
    with catalog.open(step) as ckpt:
        tree = ckpt.manifest.tree
    dcp = tree.get("dcp") if isinstance(tree, dict) else None
    return isinstance(dcp, dict) and dcp.get("encoding") == "tiersave.dcp/1"


def _export_dcp(args: argparse.Namespace, out: Output, step: int) -> int:
    """A DCP checkpoint: its tensors are sharded chunks; consolidate each into one tensor (needs torch)."""
    from ..dcp import export_safetensors as export_dcp

    if args.tag is not None and args.step is None:
        args.step = step
    summary = export_dcp(
        args.root,
        args.dest,
        step=step,
        prefix=args.prefix,
        skip_unsupported=args.skip_unsupported,
        overwrite=args.force,
    )
    text = (
        f"exported {summary.tensors} tensors ({human_bytes(summary.bytes)}) of DCP step {step}, consolidated "
        f"from their shards, to {summary.path}"
    )
    if summary.pickled:
        text += f"\nleft out {len(summary.pickled)} non-tensor value(s): {', '.join(summary.pickled[:5])}"
    data = {
        "path": summary.path,
        "step": step,
        "tensors": summary.tensors,
        "bytes": summary.bytes,
        "skipped": list(summary.skipped),
        "left_out": list(summary.pickled),
    }
    out.emit(data, text)
    return EXIT_OK
