"""Hugging Face ``transformers`` Trainer integration: the Trainer's checkpoints go through tiersave.

Scope: ``TiersaveTrainer``, a ``transformers.Trainer`` whose checkpoints (model, optimizer, LR scheduler,
grad scaler, every RNG, the ``TrainerState`` with global step, epoch, best metric, log history and
callback state; the data position follows from the step, as in the Trainer's own resume) are saved with
``Checkpointer.save_async`` into the checkpointer's tiers instead of ``checkpoint-N`` directories, and
restored by ``train(resume_from_checkpoint=...)``; retention by the checkpointer keeps the checkpoint
the Trainer calls best (``retention_for``). Anti-scope: multi-process training (DDP,
DeepSpeed, FSDP: refused with ``ConfigError``), hyper-parameter search, pushing to the Hub.

Why a Trainer subclass and not a ``TrainerCallback``: a callback runs after the Trainer has already
written (pickled) its own ``checkpoint-N`` directory and rotated old ones, and it has no say in resuming:
the Trainer reads ``trainer_state.json``, the optimizer and the RNG files from a directory at fixed points
of its loop (the trainer state before the epoch and batch-skip arithmetic, the optimizer after it is
created, the RNG after the skipped batches). A subclass overrides exactly those points, so the user code
stays the Trainer's own: ``TiersaveTrainer(..., checkpointer=...)`` and ``train(resume_from_checkpoint=True)``.
It composes with other Trainer subclasses by inheritance: ``class MyTrainer(TiersaveTrainer, SFTTrainer)``.

Example::

    from tiersave.integrations.hf import TiersaveTrainer

    args = TrainingArguments("out", save_steps=500, eval_strategy="steps", eval_steps=500,
                             metric_for_best_model="eval_loss", save_total_limit=2)
    trainer = TiersaveTrainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                              checkpointer="/checkpoints/run1")   # keeps the last 2 and the best
    trainer.train(resume_from_checkpoint=trainer.checkpointer.latest() is not None)

The Trainer's methods overridden here are private (``_save_checkpoint``, ``_init_training_state``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``, ``_load_best_model``,
``_inner_training_loop``); the ``hf`` extra pins the ``transformers`` versions they are tested against.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import transformers
from transformers import Trainer, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import compare_trainer_and_checkpoint_args

from tiersave import Checkpointer, RNGState, SaveHandle, Tier
from tiersave._lifecycle import after_timeout
from tiersave.errors import (
    CheckpointNotFoundError,
    ConfigError,
    SaveTimeoutError,
    StateMismatchError,
    TiersaveWarning,
)
from tiersave.policy import CheckpointLike, KeepAny, KeepLast, RetentionPolicy

__all__ = ["TiersaveTrainer", "TrainerBest", "best_metric_name", "retention_for"]

_MARKER = "tiersave:step="
"""Prefix of the ``resume_from_checkpoint`` value handed to the Trainer's loop, and of
``TrainerState.best_model_checkpoint``: a tiersave step, not a directory."""

log = logging.getLogger(__name__)

_KEYS = ("model", "optimizer", "lr_scheduler", "scaler", "rng", "trainer_state")


def best_metric_name(args: TrainingArguments) -> str | None:
    """The metric the Trainer ranks checkpoints by, as recorded in tiersave's metrics (``eval_`` prefixed).

    Args:
        args: the Trainer's arguments.

    Returns:
        ``"eval_" + metric_for_best_model`` (unless it already starts with ``eval_``), or None.
    """
    metric = args.metric_for_best_model
    if metric is None:
        return None
    return metric if metric.startswith("eval_") else f"eval_{metric}"


@dataclasses.dataclass(frozen=True)
class TrainerBest:
    """Keep the checkpoint the Trainer calls its best: the newest save tagged ``"best"``.

    The Trainer names a save its best (``best_model_checkpoint``, what ``load_best_model_at_end`` loads)
    only when that save's own step set a new best score, and :class:`TiersaveTrainer` tags exactly those
    saves. Ranking the stored saves by their scores instead (``KeepBest``) can disagree: a better score at
    an evaluation between saves leaves the Trainer's best at an older save that a later, unsaved-best save
    out-scores, and ties go the other way; the save the Trainer would load was then deleted.
    """

    tag: str = "best"

    def keep(self, checkpoints: Sequence[CheckpointLike]) -> frozenset[int]:
        """The newest step among ``checkpoints`` carrying the tag (none if no checkpoint has it)."""
        tagged = [c.step for c in checkpoints if self.tag in c.tags]
        return frozenset([max(tagged)]) if tagged else frozenset()

    def __str__(self) -> str:
        return f"newest tag={self.tag}"


def retention_for(args: TrainingArguments, keep_last: int | None = None) -> RetentionPolicy | None:
    """The retention that matches a Trainer's arguments: the newest ``keep_last`` (default
    ``args.save_total_limit``) plus the checkpoint the Trainer calls best (:class:`TrainerBest`) when
    ``args.metric_for_best_model`` is set.

    Unlike the Trainer's own rotation, the best checkpoint is a separate part of the policy and is never
    rotated out by newer ones. Use it on a tier: ``Tier("/ckpt/run1", keep=retention_for(args))``.

    Args:
        args: the Trainer's arguments.
        keep_last: how many newest checkpoints to keep (None: ``args.save_total_limit``).

    Returns:
        The policy, or None (keep everything) when neither a limit nor a best metric is set.
    """
    n = keep_last if keep_last is not None else args.save_total_limit
    parts: list[RetentionPolicy] = []
    if n is not None:
        parts.append(KeepLast(n))
    if best_metric_name(args) is not None:
        parts.append(TrainerBest())
    return KeepAny(tuple(parts)) if parts else None


class TiersaveTrainer(Trainer):  # type: ignore[misc]
    """A ``transformers.Trainer`` whose checkpoints are tiersave checkpoints.

    Every save the Trainer decides on (``save_strategy``, ``save_steps``, ``control.should_save``) becomes
    ``checkpointer.save_async(global_step, state, metrics=<eval metrics of this step>)``: training
    blocks only while the state is staged. A save at a new best evaluation metric is tagged ``"best"``.
    ``train()`` waits for the last save and re-raises its error; ``trainer.checkpointer`` stays open for
    listing and restoring (it is closed at interpreter exit, or call ``close()``).

    Args:
        *args: passed to ``transformers.Trainer``.
        checkpointer: a :class:`tiersave.Checkpointer` (its tiers' retention applies; the Trainer's
            ``save_total_limit`` must then be unset), or a root path/URI: a one-tier checkpointer is made
            with ``keep=retention_for(args)``.
        **kwargs: passed to ``transformers.Trainer``.

    Raises:
        ConfigError: ``save_total_limit`` together with a ready Checkpointer (two retentions), or
            ``save_only_model`` (a resumable checkpoint needs the optimizer).
    """

    def __init__(self, *args: Any, checkpointer: Checkpointer | str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.save_only_model:
            raise ConfigError(
                "TiersaveTrainer saves resumable checkpoints (model, optimizer, scheduler, RNG, trainer state); "
                "save_only_model=True is not supported: export weights with trainer.save_model() or "
                "`tiersave export ROOT --to model.safetensors --prefix model.`"
            )
        if isinstance(checkpointer, Checkpointer):
            if self.args.save_total_limit is not None:
                raise ConfigError(
                    "save_total_limit is set and a ready Checkpointer was given: retention is the Checkpointer's; "
                    "set it on its tiers, e.g. Tier(root, keep=tiersave.integrations.hf.retention_for(args))"
                )
            self.checkpointer = checkpointer
        else:
            self.checkpointer = Checkpointer(tiers=[Tier(checkpointer, keep=retention_for(self.args))])
        self._tiersave_resume: int | None = None
        self._tiersave_loaded: dict[str, Any] | None = None
        self._tiersave_last: SaveHandle | None = None  # the newest save this Trainer asked for
        self._tiersave_deadline: float | None = None  # one exit_timeout_s for the best load and train()'s end
        self.skipped_best_saves = 0
        """Saves of a new best step that ``on_busy="skip"`` skipped: the Trainer's best stayed the one before."""

    # -- entry point ------------------------------------------------------------------------------

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | int | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """Train, resuming from a tiersave checkpoint when asked.

        Args:
            resume_from_checkpoint: ``True``: the newest checkpoint of the checkpointer (any tier); an
                int: that step; a directory written by a plain ``Trainer`` (``checkpoint-N``): the
                Trainer's own resume; None/False: start fresh.
            *args: passed to ``Trainer.train``.
            **kwargs: passed to ``Trainer.train``.

        Returns:
            The Trainer's ``TrainOutput``.

        Raises:
            CheckpointNotFoundError: no checkpoint to resume from.
            ConfigError: a multi-process job, or an unusable ``resume_from_checkpoint``.
            TiersaveError: the last save failed (raised once training is done).
        """
        self._check_supported()
        passthrough: str | None = None
        if resume_from_checkpoint is True:
            latest = self.checkpointer.latest()
            if latest is None:
                raise CheckpointNotFoundError(
                    f"resume_from_checkpoint=True but there is no checkpoint in {', '.join(self.checkpointer.tiers)}"
                )
            self._tiersave_resume = latest.step
        elif isinstance(resume_from_checkpoint, int) and not isinstance(resume_from_checkpoint, bool):
            self._tiersave_resume = self.checkpointer.info(resume_from_checkpoint).step
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            if not os.path.isfile(os.path.join(resume_from_checkpoint, "trainer_state.json")):
                raise ConfigError(
                    f"resume_from_checkpoint={resume_from_checkpoint!r}: give True (the newest tiersave "
                    "checkpoint), a step number, or a checkpoint-N directory of a plain Trainer"
                )
            passthrough = os.fspath(resume_from_checkpoint)
        elif resume_from_checkpoint not in (None, False):
            raise ConfigError(
                f"resume_from_checkpoint must be True, a step, a path or None, got {resume_from_checkpoint!r}"
            )
        self._tiersave_deadline = None
        try:
            output = super().train(passthrough, *args, **kwargs)
        except BaseException:
            # Finish (or give up on) the save in flight without hiding the training error.
            self.checkpointer.wait(self._time_left(), raise_errors=False)
            raise
        finally:
            self._tiersave_resume = None
            self._tiersave_loaded = None
        timeout = self.checkpointer.exit_timeout_s
        if not self.checkpointer.wait(self._time_left()):  # a failed save raises as itself
            committed, words = after_timeout(self.checkpointer, f"within {timeout:g} s")
            if not committed:
                raise SaveTimeoutError(words)
            # Durable already: only a drain or retention goes on (the exit hook waits for it again).
            warnings.warn(f"tiersave: {words}", TiersaveWarning, stacklevel=2)
        return output

    def _time_left(self) -> float:
        """What is left of the one ``exit_timeout_s`` that the end of ``train()`` spends, in all, waiting for
        the saves (the best load's wait for its commit included); it starts with the first such wait."""
        if self._tiersave_deadline is None:
            self._tiersave_deadline = time.monotonic() + self.checkpointer.exit_timeout_s
        return max(0.0, self._tiersave_deadline - time.monotonic())

    def _check_supported(self) -> None:
        if self.args.world_size > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ConfigError(
                "TiersaveTrainer supports single-process training (CPU or one accelerator); this job has "
                f"world_size={self.args.world_size}, deepspeed={self.is_deepspeed_enabled}, fsdp={self.is_fsdp_enabled}"
            )

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        step = self._tiersave_resume
        if step is None:
            return super()._inner_training_loop(*args, **kwargs)
        # Read once, before the Trainer derives epochs and batches to skip from the trainer state: the
        # model's tensors are read straight into its parameters, the rest is kept for the loop's hooks.
        self._tiersave_loaded = self._read(step)
        kwargs["resume_from_checkpoint"] = f"{_MARKER}{step}"
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            self._tiersave_loaded = None

    def _read(self, step: int) -> dict[str, Any]:
        into: dict[str, Any] = dict.fromkeys(_KEYS)
        into["model"] = self.model
        loaded: dict[str, Any] = self.checkpointer.restore(step, into=into, strict=False)
        for key in ("optimizer", "lr_scheduler", "rng", "trainer_state"):
            if loaded.get(key) is None:
                raise StateMismatchError(
                    f"the checkpoint of step {step} has no {key!r}: it was not written by TiersaveTrainer "
                    "(restore it with Checkpointer.restore instead)"
                )
        if not isinstance(loaded["trainer_state"], str):
            raise StateMismatchError(f"the checkpoint of step {step}: 'trainer_state' is not a JSON string")
        return loaded

    def _loaded(self, checkpoint: str | None) -> dict[str, Any] | None:
        if checkpoint is None or not checkpoint.startswith(_MARKER):
            return None
        if self._tiersave_loaded is None:
            raise ConfigError(f"{checkpoint}: the tiersave checkpoint was not read before the Trainer asked for it")
        return self._tiersave_loaded

    # -- resume hooks -----------------------------------------------------------------------------

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        loaded = self._loaded(resume_from_checkpoint)
        if loaded is None:
            return super()._init_training_state(  # type: ignore[no-any-return]
                max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
            )
        super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial)
        # What the Trainer does with trainer_state.json, from the string stored in the checkpoint.
        self.state = TrainerState(**json.loads(loaded["trainer_state"]))
        best = self.state.best_model_checkpoint
        if best is not None and not self._holds(best):
            warnings.warn(
                f"the best checkpoint {best} recorded in the resumed state is no longer stored; ignoring it",
                stacklevel=2,
            )
            self.state.best_model_checkpoint = None
        compare_trainer_and_checkpoint_args(self.args, self.state)  # type: ignore[no-untyped-call]
        self._load_callback_state()
        epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)
        steps_trained_in_current_epoch = 0
        if not self.args.ignore_data_skip:
            steps_trained_in_current_epoch = self.state.global_step % num_update_steps_per_epoch
            steps_trained_in_current_epoch *= self.args.gradient_accumulation_steps
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)  # type: ignore[no-untyped-call]
        return epochs_trained, steps_trained_in_current_epoch

    def _holds(self, marker: str) -> bool:
        if not marker.startswith(_MARKER):
            return False
        try:
            self.checkpointer.info(int(marker.removeprefix(_MARKER)))
        except (CheckpointNotFoundError, ValueError):
            return False
        return True

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        loaded = self._loaded(checkpoint)
        if loaded is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        if self.optimizer is None or self.lr_scheduler is None:
            raise ConfigError("the Trainer has no optimizer or LR scheduler to load the checkpoint's state into")
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.lr_scheduler.load_state_dict(loaded["lr_scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        loaded = self._loaded(checkpoint)
        if loaded is None:
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and loaded.get("scaler") is not None:
            scaler.load_state_dict(loaded["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        loaded = self._loaded(checkpoint)
        if loaded is None:
            super()._load_rng_state(checkpoint)
            return
        RNGState().load_state_dict(loaded["rng"])

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not best.startswith(_MARKER):
            super()._load_best_model()
            return
        step = int(best.removeprefix(_MARKER))
        pending = self._tiersave_last
        # Stored already (the usual case): load it now, whatever later saves' drains are doing. Otherwise it is
        # the save still being written: wait for its commit only, not for its drains to later tiers.
        if not self._holds(best) and pending is not None and pending.step == step:
            if not pending.wait(self._time_left()):
                raise SaveTimeoutError(
                    f"cannot load the best step {step}: its save had not committed within "
                    f"{self.checkpointer.exit_timeout_s:g} s; it goes on in the background and becomes visible "
                    "only if it commits"
                )
            pending.result()  # a failed save raises as itself
        self.checkpointer.restore(step, into={"model": self.model}, strict=False)

    # -- save -------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if trial is not None or self.hp_search_backend is not None:
            raise ConfigError("TiersaveTrainer does not support hyper-parameter search")
        self.store_flos()
        step = self.state.global_step
        best, previous_best = self.state.best_global_step == step, self.state.best_model_checkpoint
        if best:  # what this save's trainer state records, and what the Trainer loads at the end if it is saved
            self.state.best_model_checkpoint = f"{_MARKER}{step}"
        # Exportable callbacks' state goes into the trainer state, as the Trainer does before writing it.
        stateful: Any = self.state.stateful_callbacks  # a dict by name once training started
        for cb in [c for c in [*self.callback_handler.callbacks, self.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(stateful[name], list):
                stateful[name].append(cb.state())
            else:
                stateful[name] = cb.state()
        state: dict[str, Any] = {
            "model": self.model,
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "rng": RNGState(),
            # The JSON the Trainer writes as trainer_state.json.
            "trainer_state": json.dumps(dataclasses.asdict(self.state), sort_keys=True),
        }
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        try:
            handle = self.checkpointer.save_async(
                step,
                state,
                metrics=_eval_metrics(self.state.log_history, step),
                tags=("best",) if best else (),
                metadata={"writer": "tiersave.integrations.hf", "transformers": transformers.__version__},
            )
        except BaseException:  # nothing of this step is stored (on_busy="raise", a bad state): not the best
            self.state.best_model_checkpoint = previous_best
            raise
        self._tiersave_last = handle
        if best and handle.skipped:
            self._best_not_saved(step, previous_best)

    def _best_not_saved(self, step: int, previous_best: str | None) -> None:
        """``on_busy="skip"`` skipped the save of a new best step: nothing of it is stored, so the Trainer's
        best stays the save it named before (what ``load_best_model_at_end`` loads, what retention keeps), as
        when a best score falls between two saves."""
        self.state.best_model_checkpoint = previous_best
        self.skipped_best_saves += 1
        level = logging.WARNING if self.skipped_best_saves == 1 else logging.DEBUG  # said once, then counted
        log.log(
            level,
            "the save of step %d, a new best by %s, was skipped (the checkpointer's on_busy='skip': the previous "
            "save was still being written); the Trainer's best stays %s (%d such skips so far, counted in "
            "trainer.skipped_best_saves)",
            step,
            best_metric_name(self.args),
            previous_best or "unset",
            self.skipped_best_saves,
        )


def _eval_metrics(log_history: Sequence[Mapping[str, Any]], step: int) -> dict[str, float]:
    """The evaluation metrics logged at ``step`` (what keep-best retention ranks by)."""
    metrics: dict[str, float] = {}
    for entry in reversed(log_history):
        if entry.get("step") != step:
            break
        for key, value in entry.items():
            if (
                key.startswith("eval_")
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                metrics.setdefault(key, float(value))
    return metrics
