"""``tiersave export``: write a checkpoint's tensors as a safetensors file."""

from __future__ import annotations

import argparse
from typing import Any

from ..units import human_bytes
from ._common import EXIT_OK, Output, add_json_flag


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
    result = export_safetensors(
        catalog,
        step,
        args.dest,
        prefix=args.prefix,
        skip_unsupported=args.skip_unsupported,
        overwrite=args.force,
    )
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
