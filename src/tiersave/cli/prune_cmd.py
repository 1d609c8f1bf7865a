"""``tiersave prune``: delete old checkpoints and leftovers of interrupted saves."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import EXIT_OK, Output, add_json_flag, positive_int


def register(sub: Any) -> None:
    p = sub.add_parser(
        "prune",
        help="delete old checkpoints and leftovers of interrupted saves",
        description="Keep the newest N checkpoints, delete the rest (each un-committed atomically before its "
        "files go), and remove the temporary directories of saves that died. A running save's directory is kept.",
    )
    p.add_argument("root", help="a path, file://, mem://NAME or s3://bucket/prefix URI")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--keep-last", type=positive_int, help="keep this many newest checkpoints (default: keep all)")
    which.add_argument(
        "--policy",
        metavar="SPEC",
        help="keep what this retention spec keeps, e.g. 'last=3,every=1000,best=2:loss:min,tag=milestone' "
        "(the newest checkpoint is always kept)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="also remove temporary directories made on other hosts (shared file systems)",
    )
    add_json_flag(p)
    p.set_defaults(handler=_prune)


def _prune(args: argparse.Namespace, out: Output) -> int:
    from ..catalog import Catalog
    from ..policy import parse_policy
    from ..storage import open_storage

    policy = parse_policy(args.policy) if args.policy else None
    catalog = Catalog(open_storage(args.root, create=False))
    result = catalog.prune(args.keep_last, policy=policy, dry_run=args.dry_run, force=args.force)
    verb = "would delete" if args.dry_run else "deleted"
    lines = [
        f"{verb} {len(result.deleted)} checkpoint(s): {', '.join(map(str, result.deleted)) or '-'}",
        f"{verb} {len(result.leftovers_removed)} leftover(s): {', '.join(result.leftovers_removed) or '-'}",
        f"kept {len(result.kept)} checkpoint(s): {', '.join(map(str, result.kept)) or '-'}",
    ]
    if result.live_saves:
        lines.append(f"left {len(result.live_saves)} directory(ies) of running saves: {', '.join(result.live_saves)}")
    out.emit({"dry_run": args.dry_run, **result.to_json()}, "\n".join(lines))
    return EXIT_OK
