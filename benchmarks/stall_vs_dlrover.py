"""The `save_async` stall against DLRover's copy into shared memory, paired round by round in one process.

`tiersave bench` times the stall among DCP's `async_save` and a single-threaded `memcpy`, each leaving the
next a dropped page cache, a deleted checkpoint or a busy disk, so its median of a few rounds swings by 10-20%
on a shared machine. This script alternates only the two contenders the target compares, with the bench's own
methods: ``tiersave-async`` (``Checkpointer.save_async`` with the auto policy and the directory's calibration;
the stall is the time the call blocked, after which the save is waited for and removed, untimed) and
``dlrover-shm`` (``Tensor.copy_`` of every tensor into tensors laid out in one touched ``/dev/shm`` buffer),
on the bench's GPT-like state, the page cache evicted before each, the order reversed every round, one
warm-up round first (a job's first save allocates its staging memory).

Prints per round both stalls and tiersave's staging copy (``stage_s``), then the medians and the median over
the rounds of DLRover's stall over tiersave's (>= 1.0: tiersave blocks no longer).

``--memmove-too`` adds a third contender, ``tiersave-memmove``: the same ``save_async`` with
``TIERSAVE_STAGE_COPY=memmove`` (glibc's ``memmove`` instead of the streaming copy), the three rotated each round,
to time what the streaming copy itself gains in the same process.

Usage::

    .venv/bin/python benchmarks/stall_vs_dlrover.py --dir DIR --gb 3 --rounds 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
from pathlib import Path

from save_vs_raw import refuse_unless_empty

from tiersave.bench.device import evict
from tiersave.bench.methods import Method, TiersaveAsyncMethod
from tiersave.bench.references import DLRoverShmMethod, SharedBuffer
from tiersave.bench.workload import build_state, gpt_like_spec
from tiersave.engine.memcopy import large_copy, stream_available
from tiersave.knobs import override_env
from tiersave.storage.posix import filesystem_type
from tiersave.storage.posix.calibration import calibration_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="a new or empty directory for tiersave's saves")
    ap.add_argument("--gb", type=float, default=3.0, help="state size in GB (default 3)")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (default 8)")
    ap.add_argument("--no-drop-caches", action="store_true", help="evict with fadvise only")
    ap.add_argument("--json", type=Path, help="also write the measurements here")
    ap.add_argument("--memmove-too", action="store_true", help="also time save_async staging with memmove")
    args = ap.parse_args()
    if args.gb <= 0 or args.rounds < 1:
        ap.error("--gb must be positive and --rounds at least 1")
    if args.memmove_too and not stream_available():
        ap.error("--memmove-too compares the streaming copy with memmove, and the streaming copy was not built here")
    refuse_unless_empty(ap, args.dir, args.json)  # and it is removed at the end
    args.dir.mkdir(parents=True, exist_ok=True)
    state = build_state(gpt_like_spec("llama3-8b", int(args.gb * 1e9)), seed=0)
    cal = calibration_for(args.dir, filesystem_type(args.dir), refresh=False)
    contenders: list[tuple[str, Method]] = [
        ("tiersave", TiersaveAsyncMethod(calibration=cal)),
        ("dlrover", DLRoverShmMethod(SharedBuffer())),
    ]
    if args.memmove_too:
        contenders.append(("memmove", _memmove_contender(cal)))
    rows: list[dict[str, float]] = []
    routines: dict[str, str] = {}  # each tiersave contender's staging copy, as its Checkpointer chose it
    try:
        for name, m in contenders:
            if name == "dlrover":
                m.prepare(args.dir)
                continue
            with override_env("TIERSAVE_STAGE_COPY", "memmove") if name == "memmove" else contextlib.nullcontext():
                m.prepare(args.dir)  # the routine is chosen when its Checkpointer is made
                routines[name] = large_copy()[1]
        for rnd in range(args.rounds + 1):
            row: dict[str, float] = {}
            turn = rnd % len(contenders)
            for name, m in contenders[turn:] + contenders[:turn]:
                evict([args.dir], drop_caches=not args.no_drop_caches)
                timing = m.save(rnd, state)
                m.remove(rnd)
                row[name] = timing.blocked_s
                if name in ("tiersave", "memmove"):
                    row[f"{name}_stage"] = float(timing.stats.get("stage_s", 0.0))
            if rnd == 0:
                continue  # the warm-up: tiersave allocates its staging memory
            row["load"] = os.getloadavg()[0]
            rows.append(row)
            also = f" memmove {row['memmove'] * 1e3:6.1f} ms" if "memmove" in row else ""
            print(
                f"round {rnd}: tiersave {row['tiersave'] * 1e3:6.1f} ms (staging copy "
                f"{row['tiersave_stage'] * 1e3:6.1f}) dlrover {row['dlrover'] * 1e3:6.1f} ms{also}  "
                f"load {row['load']:.2f}",
                flush=True,
            )
    finally:
        for _, m in contenders:
            m.close()
        shutil.rmtree(args.dir, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "load"}
    ratio = statistics.median(r["dlrover"] / r["tiersave"] for r in rows)
    print(
        f"median: tiersave {med['tiersave'] * 1e3:.1f} ms, dlrover {med['dlrover'] * 1e3:.1f} ms; "
        f"dlrover/tiersave, median of the rounds: {ratio:.2f}x (>= 1.0: tiersave blocks no longer)"
    )
    if args.memmove_too:
        gain = statistics.median(r["memmove"] / r["tiersave"] for r in rows)
        print(
            f"staging with memmove: {med['memmove'] * 1e3:.1f} ms; memmove/tiersave, median of the rounds: "
            f"{gain:.2f}x (the streaming copy's gain)"
        )
    if args.json:
        doc: dict[str, object] = {"gb": args.gb, "rounds": rows, "median_s": med, "dlrover_over_tiersave": ratio}
        doc["stage_copy"] = routines
        if args.memmove_too:
            doc["memmove_over_tiersave"] = gain
        args.json.write_text(json.dumps(doc, indent=1))


def _memmove_contender(cal: object) -> TiersaveAsyncMethod:
    m = TiersaveAsyncMethod(calibration=cal)
    m.name = m.inner.name = "tiersave-memmove"  # its own directory
    return m


if __name__ == "__main__":
    main()
