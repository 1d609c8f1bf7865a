"""TiersaveTrainer with the real ``transformers`` Trainer on a tiny GPT-2 built from a config (no download):
an interrupted and resumed run equals an uninterrupted one bit for bit; keep-best retention."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import logging
import shutil
import threading
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import tiersave
from tiersave.integrations.hf import TiersaveTrainer, retention_for
from tiersave.storage.memory import shm_base
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import FaultyStorage
from tiersave.tiers import Tier

pytestmark = pytest.mark.timeout(180)

VOCAB, SEQ, SAMPLES, BATCH = 64, 16, 24, 4  # 6 optimizer steps per epoch, 2 epochs


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    # Dropout stays on (GPT-2's default 0.1): resuming exactly needs the RNG state too.
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    )


class StopAt(TrainerCallback):
    """Interrupts training after a step, as a crash or preemption right after that step's save would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def make_args(out: Path, **overrides: Any) -> TrainingArguments:
    kwargs: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": BATCH,
        "num_train_epochs": 2,
        "learning_rate": 3e-3,
        "lr_scheduler_type": "linear",
        "warmup_steps": 2,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 2,
        "report_to": "none",
        "use_cpu": True,
        "seed": 1234,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def losses(trainer: Any) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def mem_uri():
    name = f"test-hf-{uuid.uuid4().hex[:12]}"
    yield f"mem://{name}"
    shutil.rmtree(shm_base() / name, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The uninterrupted run, with the plain Trainer (no tiersave involved)."""
    from transformers import Trainer

    out = tmp_path_factory.mktemp("reference")
    trainer = Trainer(model=tiny_gpt2(), args=make_args(out, save_strategy="no"), train_dataset=Tokens(SAMPLES, 7))
    trainer.train()
    return losses(trainer), weights(trainer.model)


@pytest.mark.parametrize("stop_at", [6, 8], ids=["epoch-boundary", "mid-epoch"])
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, mem_uri, reference, stop_at):
    ref_losses, ref_weights = reference
    assert sorted(ref_losses) == list(range(1, 13))
    disk = tmp_path / "ckpt"

    def checkpointer() -> tiersave.Checkpointer:
        return tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(disk, keep=3)])

    first = TiersaveTrainer(
        model=tiny_gpt2(),
        args=make_args(tmp_path / "out"),
        train_dataset=Tokens(SAMPLES, 7),
        callbacks=[StopAt(stop_at)],
        checkpointer=checkpointer(),
    )
    first.train()
    assert first.state.global_step == stop_at
    first.checkpointer.close()
    # The Trainer wrote no checkpoint-N directories of its own: every save went to the tiers.
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    # Saves went to both tiers: all in memory, to disk as fast as its drain keeps up (it may thin them out).
    with tiersave.Checkpointer(tiers=[Tier(mem_uri), Tier(disk)]) as both:
        held = {c.step: c.tiers for c in both.list()}
    assert max(held) == stop_at and all(s % 2 == 0 for s in held)
    assert any(len(tiers) == 2 for tiers in held.values())

    # A new process would build everything anew: a differently initialised model proves the weights come
    # from the checkpoint.
    resumed = TiersaveTrainer(
        model=tiny_gpt2(seed=99),
        args=make_args(tmp_path / "out"),
        train_dataset=Tokens(SAMPLES, 7),
        checkpointer=checkpointer(),
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.checkpointer.last_restore is not None and resumed.checkpointer.last_restore.step == stop_at
    got = losses(resumed)
    assert sorted(got) == list(range(1, 13))
    mismatched = {s: (got[s], ref_losses[s]) for s in got if got[s] != ref_losses[s]}
    assert not mismatched, f"losses differ from the uninterrupted run at steps {mismatched}"
    final = weights(resumed.model)
    assert all(torch.equal(final[k], ref_weights[k]) for k in ref_weights)
    resumed.checkpointer.close()


def scored_trainer(
    tmp_path: Path, scores: dict[int, float], *, checkpointer: Any = None, callbacks: Any = (), **overrides: Any
) -> tuple[Any, dict[int, Any]]:
    """A Trainer whose evaluation score (higher is better) at each step is scripted, keeping 1 checkpoint plus
    the best and loading the best at the end; also the weights at each save, as the Trainer saw them.
    ``checkpointer``: a function of the Trainer's arguments making its Checkpointer (default: a root path)."""
    holder: dict[str, Any] = {}

    def compute_metrics(_pred: Any) -> dict[str, float]:
        return {"score": scores[holder["trainer"].state.global_step]}

    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Snapshot(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            seen[state.global_step] = weights(model)

    args = make_args(
        tmp_path / "out",
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=None if checkpointer is not None else 1,
        metric_for_best_model="score",
        greater_is_better=True,
        load_best_model_at_end=True,
        **overrides,
    )
    trainer = TiersaveTrainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=Tokens(SAMPLES, 7),
        eval_dataset=Tokens(8, 3),
        compute_metrics=compute_metrics,
        callbacks=[Snapshot(), *callbacks],
        checkpointer=checkpointer(args) if checkpointer is not None else tmp_path / "ckpt",
    )
    holder["trainer"] = trainer
    return trainer, seen


def scored_run(tmp_path: Path, scores: dict[int, float], **overrides: Any) -> tuple[Any, dict[int, Any]]:
    """:func:`scored_trainer`, trained (which loads the Trainer's best at the end: it must still be stored)."""
    trainer, seen = scored_trainer(tmp_path, scores, **overrides)
    trainer.train()
    return trainer, seen


def test_keep_best_retention_keeps_the_best_by_eval_metric_and_loads_it_at_end(tmp_path):
    # The best is early, so rotation would drop it.
    trainer, seen = scored_run(tmp_path, {2: 0.5, 4: 0.9, 6: 0.3, 8: 0.7, 10: 0.2, 12: 0.1})
    ckpt = trainer.checkpointer
    assert [c.step for c in ckpt.list()] == [4, 12]  # the best (by eval_score) and the newest
    assert ckpt.info(4).metrics["eval_score"] == 0.9 and "best" in ckpt.info(4).tags
    assert trainer.state.best_global_step == 4 and trainer.state.best_metric == 0.9
    assert all(torch.equal(v, seen[4][k]) for k, v in trainer.model.state_dict().items())  # best loaded at end
    ckpt.restore(tag="best")
    assert ckpt.last_restore is not None and ckpt.last_restore.step == 4
    assert str(retention_for(trainer.args)) == "last=1,newest tag=best"
    ckpt.close()


def test_resume_errors_are_clear(tmp_path):
    with tiersave.Checkpointer(tmp_path / "ckpt") as ckpt:
        trainer = TiersaveTrainer(
            model=tiny_gpt2(), args=make_args(tmp_path / "out"), train_dataset=Tokens(8, 1), checkpointer=ckpt
        )
        with pytest.raises(tiersave.CheckpointNotFoundError, match="no checkpoint"):
            trainer.train(resume_from_checkpoint=True)
        with pytest.raises(tiersave.ConfigError, match="step number"):
            trainer.train(resume_from_checkpoint=str(tmp_path / "nowhere"))
        with pytest.raises(tiersave.ConfigError, match="save_total_limit"):
            TiersaveTrainer(
                model=tiny_gpt2(),
                args=make_args(tmp_path / "out", save_total_limit=2),
                train_dataset=Tokens(8, 1),
                checkpointer=ckpt,
            )


def test_a_plain_trainer_checkpoint_directory_still_resumes_the_trainers_way(tmp_path, reference):
    from transformers import Trainer

    ref_losses, _ = reference
    plain = Trainer(
        model=tiny_gpt2(), args=make_args(tmp_path / "out"), train_dataset=Tokens(SAMPLES, 7), callbacks=[StopAt(4)]
    )
    plain.train()
    assert (tmp_path / "out" / "checkpoint-4").is_dir()
    migrated = TiersaveTrainer(
        model=tiny_gpt2(seed=5),
        args=make_args(tmp_path / "out2"),
        train_dataset=Tokens(SAMPLES, 7),
        checkpointer=tmp_path / "ckpt",
    )
    migrated.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert losses(migrated) == ref_losses
    assert [c.step for c in migrated.checkpointer.list()][-1] == 12  # from then on, saves go to tiersave
    migrated.checkpointer.close()


def test_the_best_the_trainer_names_survives_a_better_score_at_a_step_between_saves(tmp_path):
    """The Trainer names a save its best only when the new best score is that save's own step. A better
    score at an evaluation between saves leaves its best at the older save, while a later save can score
    higher than that older one: retention must still keep the save the Trainer will load at the end."""
    # Saves at 4, 8, 12: the best save is 4; 8 out-scores it; 6 (the best score) is not saved.
    trainer, seen = scored_run(tmp_path, {2: 0.1, 4: 0.5, 6: 0.9, 8: 0.7, 10: 0.2, 12: 0.1}, save_steps=4)
    ckpt = trainer.checkpointer
    assert trainer.state.best_model_checkpoint == "tiersave:step=4"
    assert [c.step for c in ckpt.list()] == [4, 12]  # the Trainer's best and the newest
    assert all(torch.equal(v, seen[4][k]) for k, v in trainer.model.state_dict().items())
    ckpt.close()


def test_a_best_save_that_on_busy_skip_skipped_is_not_named_best(tmp_path, caplog):
    """With ``on_busy="skip"``, the save of a new best step can be skipped while the previous save is still being
    written: nothing of it is stored, so the Trainer must not name it best (``load_best_model_at_end`` would
    then look for a step that was never saved); its best stays the save it named before, said once in the log."""
    scores = {2: 0.1, 4: 0.9, 6: 0.3, 8: 0.5, 10: 0.2, 12: 0.4}  # 4 is the best score, and its save is skipped
    gate = threading.Event()  # the save of step 2 is held until step 5 ends: step 4's save finds it in flight
    opened: dict[str, tiersave.Checkpointer] = {}

    class OpenAt5(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step >= 5:
                gate.set()
                # From step 5 on, every save is committed before the next one starts: on a loaded machine one
                # could still be in flight, and a second skip (step 6, or 12 behind 10) would fail this test
                # with an unexpected warning.
                assert opened["ckpt"].wait(60), "a save did not finish within 60 s"

    def gated(args: TrainingArguments) -> tiersave.Checkpointer:
        storage = FaultyStorage(LocalStorage(tmp_path / "ckpt"), gates={"finish": gate})
        return tiersave.Checkpointer(tiers=[Tier(storage, keep=retention_for(args, keep_last=1))], on_busy="skip")

    trainer, _ = scored_trainer(tmp_path, scores, checkpointer=gated, callbacks=[OpenAt5()])
    ckpt = opened["ckpt"] = trainer.checkpointer
    try:
        with (
            caplog.at_level(logging.DEBUG, logger="tiersave.integrations.hf"),
            pytest.warns(tiersave.TiersaveWarning, match="skipping the save of step 4"),
        ):
            trainer.train()  # loads the Trainer's best at the end: a step that was never saved would fail here
    finally:
        gate.set()
    assert trainer.state.best_global_step == 4 and trainer.state.best_metric == 0.9  # the Trainer's score
    assert trainer.state.best_model_checkpoint == "tiersave:step=2"  # but its best checkpoint is a saved one
    assert trainer.skipped_best_saves == 1
    assert 4 not in ckpt.catalog.steps() and 2 in ckpt.catalog.steps()  # retention kept the Trainer's best
    assert "best" in ckpt.info(2).tags
    said = [r for r in caplog.records if "a new best by eval_score, was skipped" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert "the Trainer's best stays tiersave:step=2" in said[0].getMessage()
    ckpt.close()


def test_train_loads_the_best_and_returns_once_the_saves_are_committed_though_a_drain_goes_on(tmp_path):
    """``train()`` waits for the last save to be durable, and ``load_best_model_at_end`` for the best step to be;
    a drain to a later tier that outlasts the wait is said (a warning naming the save committed and the drain),
    not raised as a save that did not finish."""
    gate = threading.Event()  # the drains to "slow" never finish while the Trainer runs

    def two_tiers(args: TrainingArguments) -> tiersave.Checkpointer:
        slow = FaultyStorage(LocalStorage(tmp_path / "slow"), gates={"finish": gate})
        fast = Tier(tmp_path / "fast", name="fast", keep=retention_for(args, keep_last=1))
        return tiersave.Checkpointer(tiers=[fast, Tier(slow, name="slow")], exit_timeout_s=0.5)

    class WaitCommit(TrainerCallback):  # each save commits on "fast" before training goes on: only drains wait
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            inflight = holder["trainer"].checkpointer._inflight
            assert inflight is not None and inflight.wait(60), "the save did not commit within 60 s"

    holder: dict[str, Any] = {}
    scores = {2: 0.1, 4: 0.9, 6: 0.3, 8: 0.5, 10: 0.2, 12: 0.4}
    trainer, seen = scored_trainer(tmp_path, scores, checkpointer=two_tiers, callbacks=[WaitCommit()])
    holder["trainer"] = trainer
    waits: list[float | None] = []
    real_wait = trainer.checkpointer.wait

    def spy(timeout: float | None = None, **kwargs: Any) -> bool:
        waits.append(timeout)
        return real_wait(timeout, **kwargs)

    trainer.checkpointer.wait = spy  # the real wait, its timeouts recorded
    try:
        with warnings.catch_warnings(record=True) as said:  # also: tier slow cannot keep up
            warnings.simplefilter("always")
            trainer.train()  # loads the best (step 4) at the end, then waits for the last save
    finally:
        gate.set()
    (message,) = [str(w.message) for w in said if "is committed in" in str(w.message)]
    assert "the save of step 12 is committed in" in message and "the drain to tier slow" in message, message
    assert "not visible" not in message, message
    assert all(torch.equal(v, seen[4][k]) for k, v in trainer.model.state_dict().items())  # the best, loaded
    # The best (step 4) was stored long before: its load did not wait for step 12's drain, and train()'s end
    # spent exit_timeout_s once (the best load used to wait it out first, then train() again).
    assert len(waits) == 1 and waits[0] is not None and waits[0] <= 0.5, waits
    trainer.checkpointer.close()


def test_a_best_save_that_save_async_refused_is_not_named_best(tmp_path):
    """on_busy="raise" refuses the save of a new best step (the previous save is held at a gate): the Trainer's
    best stays the save it named before, not a step that was never saved."""
    gate = threading.Event()

    def gated(args: TrainingArguments) -> tiersave.Checkpointer:
        storage = FaultyStorage(LocalStorage(tmp_path / "ckpt"), gates={"finish": gate})
        return tiersave.Checkpointer(storage, on_busy="raise", exit_timeout_s=0.2)

    trainer, _ = scored_trainer(tmp_path, {2: 0.1, 4: 0.9, 6: 0.3}, checkpointer=gated)
    try:
        with pytest.raises(tiersave.SaveError, match=r"step 2 is still being written \(on_busy=.raise.\)"):
            trainer.train()
        assert trainer.state.best_global_step == 4  # the Trainer's score
        assert trainer.state.best_model_checkpoint == "tiersave:step=2"  # but a step that is being saved
    finally:
        gate.set()
    assert trainer.checkpointer.wait(60)
    assert trainer.checkpointer.catalog.steps() == [2]
    trainer.checkpointer.close()
