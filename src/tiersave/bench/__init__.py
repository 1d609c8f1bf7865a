"""``tiersave bench``: a checkpoint storage benchmark in the spirit of MLPerf Storage's checkpointing workload.

A GPT-like state (fp32 weights and Adam moments, shapes from a :mod:`tiersave.planner.architecture` preset
scaled to a size) is saved N times until durable and loaded back from a cold page cache by tiersave in each I/O mode
and by the peers (``torch.save``/``torch.load``, safetensors, ``torch.distributed.checkpoint`` save, load
and async_save), next to the device's raw direct-I/O limits measured in the same run on the same
directory. The report gives throughput, ratios against the raw limits and the peers, and whether the
targets (:data:`~tiersave.bench.report.TARGETS`, explained in docs/benchmarks.md) were met.

Modules: ``config`` (what to run), ``workload`` (the state), ``device`` (raw limits, cache eviction),
``methods`` (the contenders), ``runner`` (the procedure), ``ranks`` (several processes), ``report``
(ratios, targets, plot; torch-free).
Importing this package does not import torch; :func:`run_bench` does.

Example::

    from pathlib import Path
    from tiersave.bench import BenchConfig, run_bench
    result = run_bench(BenchConfig(directory=Path("/scratch/bench"), size_bytes=3_000_000_000))
    print(result.to_json()["summary"]["ratios"])
"""

from __future__ import annotations

from .config import BenchConfig
from .report import TARGETS, plot, summarize
from .runner import BenchResult, MethodResult, run_bench
from .workload import StateSpec, TensorSpec, gpt_like_spec

__all__ = [
    "TARGETS",
    "BenchConfig",
    "BenchResult",
    "MethodResult",
    "StateSpec",
    "TensorSpec",
    "gpt_like_spec",
    "plot",
    "run_bench",
    "summarize",
]
