"""``tiersave copy``: copy committed checkpoints between any two storage URIs, verified.

Migration to another cluster, bucket or disk: every chunk is checked against its CRC-32C while it is
copied, and (unless ``--no-verify``) read back from the destination and checked again before the
destination commits it. A checkpoint the destination already holds is skipped; a different checkpoint of
the same step there is an error (nothing is overwritten).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..units import human_bytes, table
from ._common import EXIT_FAILURE, EXIT_OK, ByteProgress, Output, add_json_flag, positive_int, report_error


def _bytes(text: str) -> int:
    from ..errors import ConfigError
    from ..units import parse_bytes

    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: Any) -> None:
    p = sub.add_parser(
        "copy",
        help="copy checkpoints between two storages (verified)",
        description="Copy committed checkpoints from SRC to DST (any of: a path, file://, mem://NAME, "
        "s3://bucket/prefix?endpoint=...). Chunks are checked against their checksums while copying and, "
        "unless --no-verify, read back from DST before DST commits the copy. Default: the newest step.",
    )
    p.add_argument("src", help="source root URI")
    p.add_argument("dst", help="destination root URI (created if it is a directory or mem:// name)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="copy this step")
    g.add_argument("--all", action="store_true", help="copy every checkpoint (oldest first)")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip reading the copy back from DST (chunks are still checked while copying)",
    )
    p.add_argument(
        "--compress",
        choices=["zstd"],
        help="write DST's shards compressed (format 3.0); without it a compressed source is decoded",
    )
    p.add_argument("--threads", type=positive_int, help="parallel transfers (default TIERSAVE_IO_THREADS)")
    p.add_argument("--buffer", type=_bytes, help="memory for chunks in flight, e.g. 512MiB (default 256MiB)")
    add_json_flag(p)
    p.set_defaults(handler=_copy)


def _copy(args: argparse.Namespace, out: Output) -> int:
    from ..catalog import Catalog
    from ..drain import CopyResult, copy_checkpoint
    from ..errors import CheckpointNotFoundError
    from ..storage import open_storage

    src = open_storage(args.src, create=False)
    dst = open_storage(args.dst)
    try:
        available = Catalog(src).steps()
        if args.step is not None:
            steps = [args.step]
        elif args.all:
            steps = available
        else:
            steps = available[-1:]
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {src.uri}")
        results: list[CopyResult] = []
        started = time.perf_counter()
        for step in steps:
            bar = ByteProgress(out, f"step {step}")
            try:
                result = copy_checkpoint(
                    src,
                    dst,
                    step,
                    if_exists="skip",
                    read_back=not args.no_verify,
                    io_threads=args.threads,
                    buffer_bytes=args.buffer,
                    progress=bar.update,
                    compress=args.compress,
                )
            except Exception as exc:
                bar.close()
                _emit(out, src.uri, dst.uri, results, time.perf_counter() - started, failed=(step, exc))
                return EXIT_FAILURE
            bar.close()
            results.append(result)
            verb = "already there" if result.skipped else "copied"
            out.progress(f"step {step}: {verb} ({human_bytes(result.stored_bytes)})")
        _emit(out, src.uri, dst.uri, results, time.perf_counter() - started)
        return EXIT_OK
    finally:
        src.close()
        dst.close()


def _emit(
    out: Output,
    src: str,
    dst: str,
    results: list[Any],
    seconds: float,
    *,
    failed: tuple[int, BaseException] | None = None,
) -> None:
    doc: dict[str, Any] = {
        "source": src,
        "destination": dst,
        "copied": [r.to_json() for r in results],
        "seconds": round(seconds, 6),
        "ok": failed is None,
    }
    rows = []
    for r in results:
        status = "skipped (identical)" if r.skipped else "copied, verified" if r.read_back else "copied"
        rate = "-" if r.skipped else f"{r.bytes_per_s / 1e6:.0f} MB/s"
        written = "-" if r.skipped else human_bytes(r.file_bytes)
        rows.append([str(r.step), human_bytes(r.stored_bytes), written, f"{r.seconds:.2f} s", rate, status])
    lines = [f"{src} -> {dst}"]
    if rows:
        lines.append(table(["step", "size", "written", "time", "rate", "status"], rows))
    if failed is not None:
        step, exc = failed
        doc["failed"] = {"step": step, "type": type(exc).__name__, "message": str(exc)}
        lines.append(f"step {step}: FAILED (nothing of it was committed in {dst})")
    out.emit(doc, "\n".join(lines))
    if failed is not None:
        report_error(Output(json=False), failed[1])
