"""``tiersave tag``: point a movable tag at a committed step, move it, delete it, or list the tags of a root."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..units import table
from ._common import EXIT_FAILURE, EXIT_OK, Output, add_json_flag


def register(sub: Any) -> None:
    p = sub.add_parser(
        "tag",
        help="point a movable tag at a committed step (or move, delete, list tags)",
        description="Movable tags name one committed checkpoint and can be moved later; restore(tag=NAME), "
        "`tiersave watch ROOT --tag NAME` and retention (which keeps tagged steps) follow them. "
        "Examples: tiersave tag /ckpt/run1 1200 serving; tiersave tag /ckpt/run1 serving --delete; "
        "tiersave tag /ckpt/run1 (list).",
    )
    p.add_argument("root", help="checkpoint root: a path, file://, mem://NAME or s3://bucket/prefix")
    p.add_argument(
        "args", nargs="*", metavar="STEP NAME", help="the step and the tag's name (NAME alone with --delete)"
    )
    p.add_argument("--delete", action="store_true", help="remove the tag NAME")
    add_json_flag(p)
    p.set_defaults(handler=_tag)


def _tag(args: argparse.Namespace, out: Output) -> int:
    from ..catalog import Catalog
    from ..errors import ConfigError, FormatError
    from ..storage import open_storage

    catalog = Catalog(open_storage(args.root, create=False))
    if args.delete:
        if len(args.args) != 1:
            raise ConfigError("usage: tiersave tag ROOT NAME --delete")
        existed = catalog.tags.delete(args.args[0])
        out.emit(
            {"name": args.args[0], "deleted": existed},
            f"tag {args.args[0]!r} " + ("deleted" if existed else "did not exist"),
        )
        return EXIT_OK if existed else EXIT_FAILURE
    if not args.args:
        items, text = describe_tags(catalog)
        out.emit({"root": catalog.storage.uri, "tags": items}, text or f"no movable tag in {catalog.storage.uri}")
        return EXIT_OK
    if len(args.args) != 2:
        raise ConfigError("usage: tiersave tag ROOT STEP NAME (or ROOT NAME --delete, or ROOT to list)")
    try:
        step = int(args.args[0])
    except ValueError:
        raise ConfigError(
            f"STEP must be an integer, got {args.args[0]!r} (usage: tiersave tag ROOT STEP NAME)"
        ) from None
    try:
        previous = catalog.tags.get(args.args[1])
    except FormatError:  # a broken tag file is replaced by a good one
        previous = None
    tag = catalog.tags.set(args.args[1], step)
    moved = f" (moved from step {previous.step})" if previous is not None and previous.step != step else ""
    out.emit(tag.to_json(), f"tag {tag.name!r} -> step {tag.step}{moved}")
    return EXIT_OK


def describe_tags(catalog: Any) -> tuple[list[dict[str, Any]], str]:
    """The movable tags of ``catalog``'s root for ``tiersave ls`` and ``tiersave tag ROOT``: one item per tag
    (with ``error`` for an unreadable tag file or a tag whose step is gone) and a text table ('' if none)."""
    from ..errors import CheckpointNotFoundError, FormatError

    items: list[dict[str, Any]] = []
    rows = []
    for name in catalog.tags.names():
        try:
            tag = catalog.tags.resolve(name)
        except (CheckpointNotFoundError, FormatError) as exc:
            items.append({"name": name, "error": str(exc)})
            rows.append([name, "-", "-", f"BROKEN: {exc}"])
            continue
        if tag is None:  # deleted since the listing
            continue
        items.append(tag.to_json())
        rows.append([name, str(tag.step), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(tag.time)), "ok"])
    return items, table(["tag", "step", "set (UTC)", "status"], rows) if rows else ""
