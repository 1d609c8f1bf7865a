"""Capture and restore random-number-generator state, so a resumed run draws the same numbers.

``RNGState`` has ``state_dict()``/``load_state_dict()``, so it goes into the saved state like a model::

    state = {"model": model, "optim": optim, "rng": tiersave.RNGState()}
    ckpt.save(step, state)          # captures the generators as they are at this moment
    ckpt.restore(into=state)        # puts them back
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import StateMismatchError, TiersaveWarning


class RNGState:
    """The global generators of Python ``random``, numpy, torch CPU and every CUDA device, plus any
    named ``torch.Generator`` or ``numpy.random.Generator`` you pass.

    Args:
        generators: extra generators to capture by name (e.g. a data loader's sampler generator).
    """

    def __init__(self, generators: Mapping[str, torch.Generator | np.random.Generator] | None = None) -> None:
        self.generators = dict(generators or {})

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=False),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            state["cuda"] = torch.cuda.get_rng_state_all()
        named: dict[str, Any] = {}
        for name, gen in self.generators.items():
            if isinstance(gen, torch.Generator):
                named[name] = {"torch": gen.get_state()}
            else:
                named[name] = {"numpy": gen.bit_generator.state}
        state["generators"] = named
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            random.setstate(state["python"])
            np.random.set_state(state["numpy"])
            torch.set_rng_state(state["torch"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise StateMismatchError(f"RNG state in the checkpoint is not usable: {exc}") from exc
        cuda = state.get("cuda")
        if cuda and torch.cuda.is_available():
            count = torch.cuda.device_count()
            if count != len(cuda):
                warnings.warn(
                    f"checkpoint holds RNG state for {len(cuda)} CUDA devices, this process has {count}; "
                    "restoring the first min(both)",
                    TiersaveWarning,
                    stacklevel=2,
                )
            for index, s in enumerate(cuda[:count]):
                torch.cuda.set_rng_state(s, index)
        for name, saved in state.get("generators", {}).items():
            gen = self.generators.get(name)
            if gen is None:
                warnings.warn(
                    f"checkpoint has RNG state for generator {name!r}, which was not passed",
                    TiersaveWarning,
                    stacklevel=2,
                )
                continue
            if isinstance(gen, torch.Generator):
                gen.set_state(saved["torch"])
            else:
                gen.bit_generator.state = saved["numpy"]
