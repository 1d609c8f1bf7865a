"""Lightning integration: a ``CheckpointIO`` plugin that stores Lightning's checkpoints with tiersave.

Scope: ``TiersaveCheckpointIO``, which Lightning's ``Trainer(plugins=[...])`` uses for every checkpoint it
writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) and reads (``trainer.fit(ckpt_path=...)``,
``"last"``, ``"best"``). Anti-scope: multi-process strategies' sharded checkpoints (Lightning hands a
``CheckpointIO`` only rank 0's full dict), remote ``.ckpt`` paths.

How it maps Lightning's paths onto tiersave's steps: the checkpoint dict is saved asynchronously as the
tiersave checkpoint of its ``global_step`` (``Checkpointer.save_async``: training blocks only while the
tensors are staged), and the ``.ckpt`` path Lightning asked for becomes a small JSON *pointer* naming that
step, written atomically once the checkpoint is committed. So everything Lightning does with files keeps
working: ``ModelCheckpoint``'s top-k bookkeeping, ``last.ckpt`` (copy or link), ``ckpt_path="last"``, and
its rotation (``remove_checkpoint`` deletes the pointer, and the stored checkpoint once no pointer names
it). A second save at the same step (``save_last=True``) points to the same stored checkpoint.

Lightning's dict carries Python objects (hyper-parameters, loop state, callback state). Everything the
pickle-free format holds is stored (dicts, lists, tuples, numbers, strings, tensors, numpy arrays, objects
with ``state_dict()``); anything else fails the save with ``UnsupportedStateError`` naming its key, e.g.
``hyper_parameters.transform``. Restored values come back as those plain types (tensors on the CPU).

Example::

    from tiersave.integrations.lightning import TiersaveCheckpointIO

    io = TiersaveCheckpointIO("/checkpoints/run1")
    trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint("ckpt", monitor="val_loss", save_last=True)])
    trainer.fit(model, data, ckpt_path="last")
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from tiersave import Checkpointer, RNGState, SaveHandle
from tiersave._lifecycle import WaitOutcome, after_timeout, unfinished_message
from tiersave.engine.pool import DaemonThreadPool
from tiersave.errors import (
    CheckpointNotFoundError,
    ConfigError,
    FormatError,
    SaveTimeoutError,
    StorageError,
    TiersaveWarning,
)
from tiersave.policy import CheckpointLike
from tiersave.storage.posix.safepath import read_regular_file

__all__ = ["POINTER_FORMAT", "TiersaveCheckpointIO", "read_pointer"]

POINTER_FORMAT = "tiersave-lightning-pointer"
_METRIC_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,127}$")  # what save(metrics=...) accepts
_POLL_S = 0.25  # how often a pointer write waiting for its commit looks whether the plugin was closed
_CLOSE_GRACE_S = 2.0  # at most this long close() lets queued pointer writes run before naming the unwritten
RNG_KEY = "tiersave_rng"
"""Key under which the global RNG states (Python, numpy, torch, CUDA) are stored next to Lightning's dict:
Lightning does not save them, and the next epoch's shuffling and dropout depend on them."""


def read_pointer(path: str | os.PathLike[str]) -> int:
    """The tiersave step a ``.ckpt`` pointer written by :class:`TiersaveCheckpointIO` names.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        FormatError: the file is not such a pointer (a ``torch.save`` ``.ckpt`` is never unpickled).
    """
    try:
        raw = read_regular_file(path, 4096)  # never blocks: a FIFO among the checkpoints is no pointer
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint file at {os.fspath(path)}") from None
    except OSError:
        raw = b""
    try:
        data = json.loads(raw) if len(raw) <= 4096 else None
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("format") != POINTER_FORMAT or type(data.get("step")) is not int:
        raise FormatError(
            f"{os.fspath(path)} is not a tiersave checkpoint pointer (a torch.save .ckpt? tiersave never "
            "unpickles; load it without the TiersaveCheckpointIO plugin)"
        )
    step: int = data["step"]
    return step


class _Without:
    """Retention that keeps every checkpoint except ``steps`` (what no pointer names any more)."""

    def __init__(self, steps: frozenset[int]) -> None:
        self.steps = steps

    def keep(self, checkpoints: Sequence[CheckpointLike]) -> frozenset[int]:
        return frozenset(c.step for c in checkpoints if c.step not in self.steps)

    def __str__(self) -> str:
        return f"all but {sorted(self.steps)}"


class TiersaveCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """Lightning ``CheckpointIO`` that saves asynchronously with tiersave (see the module docstring).

    Args:
        checkpointer: a :class:`tiersave.Checkpointer` without retention of its own (``ModelCheckpoint``
            decides what is kept), or a root path/URI to make one.
        rng: also store the global RNG states and restore them on load, which an exact resume needs
            (Lightning's dict has none).
        timeout_s: the longest ``flush()`` (teardown, a load right after a save) waits, in all, for the
            saves and their pointers; default the checkpointer's ``exit_timeout_s``. A pointer whose save
            commits later is still written: only ``close()`` gives it up.

    Raises:
        ConfigError: the checkpointer has a ``keep_last`` retention.
    """

    def __init__(
        self,
        checkpointer: Checkpointer | str | os.PathLike[str],
        *,
        rng: bool = True,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        if isinstance(checkpointer, Checkpointer):
            if checkpointer.keep_last is not None:
                raise ConfigError(
                    "TiersaveCheckpointIO: the Checkpointer has keep_last set; with Lightning, ModelCheckpoint "
                    "(save_top_k, save_last) decides what is kept: make the Checkpointer without retention"
                )
            self.checkpointer = checkpointer
        else:
            self.checkpointer = Checkpointer(checkpointer)
        self.rng = rng
        self.timeout_s = float(timeout_s if timeout_s is not None else self.checkpointer.exit_timeout_s)
        self._lock = threading.Lock()
        self._handles: dict[int, SaveHandle] = {}  # steps this plugin saved, by step
        self._jobs: list[tuple[int, Future[None], SaveHandle]] = []  # pointer writes waiting for their commit
        self._given_up: set[int] = set()  # steps whose pointer write gave up at close(): not committed
        self._unreferenced: set[int] = set()  # steps whose pointer went away: delete unless named again
        self._unwritten: dict[Path, int] = {}  # pointers queued and not yet written: pending writes per path
        self._removed: set[Path] = set()  # pointers Lightning removed before their queued write ran
        self._dirs: set[str] = set()  # directories holding our pointers
        self._errors: list[BaseException] = []  # pointer writes that failed, raised by the next call
        self._closing = threading.Event()  # set by close(): pointer writes still waiting give up
        self._writer: DaemonThreadPool | None = None  # daemon: a write waiting for a commit never delays exit
        self._warned_skip = False  # on_busy="skip" skipped a save: warned once

    # -- CheckpointIO contract ---------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` as the tiersave checkpoint of its ``global_step`` and return; the pointer at
        ``path`` appears once it is committed.

        Raises:
            UnsupportedStateError: a value cannot be stored; the message names its key.
            ConfigError: ``storage_options``, a remote path, or a dict without ``global_step``.
            TiersaveError: an earlier save or pointer write failed.
        """
        if storage_options is not None:
            raise ConfigError("TiersaveCheckpointIO does not take storage_options")
        target = self._local(path)
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise ConfigError(f"Lightning's checkpoint for {target} has no usable global_step ({step!r})")
        if RNG_KEY in checkpoint:
            raise ConfigError(f"the checkpoint already has a key {RNG_KEY!r}, which TiersaveCheckpointIO reserves")
        self._raise_error()
        handle = self._handles.get(step)
        if handle is None or handle.failed():
            self._delete_unreferenced(wait=True)
            state = dict(checkpoint)
            if self.rng:
                state[RNG_KEY] = RNGState()
            # A save that fails here raises here; whatever failed before it is reported by save_async too.
            previous, self._handles = self._handles, {}
            handle = self.checkpointer.save_async(
                step,
                state,
                metrics=_metrics(checkpoint),
                metadata={"writer": "tiersave.integrations.lightning", "path": os.fspath(target)},
            )
            if handle.skipped:  # on_busy="skip": nothing stored, so no pointer may name this step
                self._handles = previous  # the save in flight is still the one to wait for
                self._skipped(target, step)
                return
            self._handles = {step: handle}  # only the newest can be asked for again
        self._point(target, step, handle)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        """Restore the checkpoint the pointer at ``path`` names (tensors on the CPU; Lightning moves them).

        Raises:
            FormatError: ``path`` is not a tiersave pointer.
            CheckpointNotFoundError: no pointer, or its checkpoint is no longer stored.
        """
        self._settle(drains=False)  # the pointer may be one whose save is still being written
        step = read_pointer(self._local(path))
        state: dict[str, Any] = self.checkpointer.restore(step)
        saved_rng = state.pop(RNG_KEY, None)
        if self.rng and saved_rng is not None:
            RNGState().load_state_dict(saved_rng)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path``; the stored checkpoint goes once no pointer names it."""
        target = self._local(path)
        with self._lock:
            if self._unwritten.get(target):  # writes still queued: none may land after this removal
                self._removed.add(target)
        if not os.path.lexists(target):
            return
        try:
            step: int | None = None if os.path.islink(target) else read_pointer(target)
        except FormatError:
            step = None  # not ours: removing the file is all Lightning asked for
        os.unlink(target)
        if step is not None:
            with self._lock:
                self._unreferenced.add(step)

    def teardown(self) -> None:
        """Wait for the last save and its pointers, apply pending deletions, re-raise any failure.

        The deletions run even when the wait failed or timed out (e.g. on a slow drain): the steps no pointer
        names would otherwise stay stored after the run."""
        try:
            self.flush()
        finally:
            self._delete_unreferenced(wait=False)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def close(self) -> None:
        """``teardown()``, then close the checkpointer. A pointer whose save had not committed by then is not
        written (a warning names it): its save goes on in the background and is restorable by its step."""
        try:
            self.teardown()
        finally:
            self._closing.set()
            left = self._unwritten_at_close()
            if left:
                warnings.warn(
                    f"tiersave: the .ckpt pointers of step(s) {left} were not written: TiersaveCheckpointIO was "
                    "closed before their saves committed (a save that commits later is stored, restorable by "
                    f"its step from {self.checkpointer.storage.uri})",
                    TiersaveWarning,
                    stacklevel=2,
                )
            self.checkpointer.close(self.timeout_s)

    def flush(self) -> None:
        """Wait until every save and pointer write so far is done, ``timeout_s`` in all.

        Raises:
            SaveTimeoutError: not done within ``timeout_s``; what is not done stays pending (a pointer is
                written once its save commits), and the next ``flush()`` (or ``teardown()``, ``close()``, a
                load) waits for it again.
            TiersaveError: a save or a pointer write failed.
        """
        self._settle(drains=True)

    def _settle(self, *, drains: bool) -> None:
        """``flush()``; without ``drains``, wait only for the saves' commits and their pointers (what a load
        needs), not for drains to later tiers or retention."""
        deadline = time.monotonic() + self.timeout_s  # one deadline for the saves and the pointers
        late: list[int] = []  # saves that had not committed (a load's wait)
        if drains:  # Checkpointer.wait would re-raise a save that failed synchronously, already raised
            finished = self.checkpointer.wait(self.timeout_s, raise_errors=False)
        else:
            late = [h.step for h in list(self._handles.values()) if not h.wait(max(0.0, deadline - time.monotonic()))]
            finished = not late
        for handle in list(self._handles.values()):  # a failed save raises as itself, before any slow drain
            err = handle.exception() if handle.failed() else None
            if err is not None:
                self._handles = {}
                raise err
        if not finished:
            raise self._timed_out() if drains else self._not_committed(late[0])
        with self._lock:
            jobs = [(step, job) for step, job, _ in self._jobs]
        try:
            for step, job in jobs:
                try:
                    job.result(max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    raise SaveTimeoutError(
                        f"the pointer of step {step} was not written within {self.timeout_s:.0f} s; "
                        f"{sum(not j.done() for _, j in jobs)} pointer write(s) still pending, which the next "
                        "flush() or teardown() waits for"
                    ) from None
        finally:  # only what is written leaves the list: a pending write is waited for by the next flush
            with self._lock:
                self._jobs = [entry for entry in self._jobs if not entry[1].done()]
        self._raise_error()

    # -- pointers ----------------------------------------------------------------------------------

    @staticmethod
    def _local(path: Any) -> Path:
        text = os.fspath(path)
        if "://" in text and not text.startswith("file://"):
            raise ConfigError(f"TiersaveCheckpointIO writes its .ckpt pointers on a local path, got {text}")
        return Path(text.removeprefix("file://"))

    def _point(self, target: Path, step: int, handle: SaveHandle) -> None:
        if self._writer is None:
            self._writer = DaemonThreadPool(1, "tiersave-lightning-pointer")
        with self._lock:
            self._unwritten[target] = self._unwritten.get(target, 0) + 1
            self._removed.discard(target)  # saved again under the same name: the newest pointer stands
        job = self._writer.submit(self._write_pointer, target, step, handle)
        with self._lock:
            self._jobs.append((step, job, handle))
            self._dirs.add(os.fspath(target.parent))

    def _write_pointer(self, target: Path, step: int, handle: SaveHandle) -> None:
        try:
            # However long the commit takes (a large model on slow storage), a good save gets its pointer;
            # only close() gives up (and says so), since nothing would then write it.
            while not handle.wait(_POLL_S):
                if self._closing.is_set():
                    with self._lock:
                        self._given_up.add(step)
                    return
            if handle.failed():
                return  # the save's own error reaches the caller through the checkpointer
            with self._lock:  # held while writing: a removal waits for this pointer, then removes it
                self._write_pointer_locked(target, step)
        except BaseException as exc:
            with self._lock:
                self._errors.append(
                    StorageError(f"could not write the checkpoint pointer {target} for step {step}: {exc}")
                )
        finally:
            with self._lock:
                left = self._unwritten.pop(target, 1) - 1
                if left:
                    self._unwritten[target] = left
                else:
                    self._removed.discard(target)

    def _write_pointer_locked(self, target: Path, step: int) -> None:
        """Write the pointer (``self._lock`` held), unless Lightning removed it while its write was queued."""
        if target in self._removed:
            self._unreferenced.add(step)
            return
        try:
            replaced: int | None = read_pointer(target)
        except (CheckpointNotFoundError, FormatError):
            replaced = None
        target.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"format": POINTER_FORMAT, "version": 1, "step": step, "tiers": self.checkpointer.tiers})
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the pointer from other readers of the run
            with os.fdopen(fd, "w") as f:
                f.write(body + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)  # a reader sees the old pointer or the new one, never half of one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if replaced is not None and replaced != step:
            self._unreferenced.add(replaced)

    def _skipped(self, target: Path, step: int) -> None:
        """A save skipped by ``on_busy="skip"``: its pointer is not written, and a pointer already at ``target``
        keeps naming its stored checkpoint (which is therefore kept). Warned once per plugin; the checkpointer
        warns at each skip and counts them in ``skipped_saves``."""
        if self._warned_skip:
            return
        self._warned_skip = True
        warnings.warn(
            f"tiersave: the save of step {step} was skipped (on_busy='skip': an earlier save was still being "
            f"written), so no pointer is written at {target}; an existing pointer there keeps naming its older "
            "step, and Lightning may list a .ckpt that does not exist. Use on_busy='wait' to store every save "
            "Lightning asks for (warned once)",
            TiersaveWarning,
            stacklevel=3,
        )

    def _unwritten_at_close(self) -> list[int]:
        """Once ``self._closing`` is set, the steps whose pointers will not be written: the writes that gave
        up, and those still queued whose save has not committed. The writer first gets a short bounded chance
        to reach the queued writes (each gives up within ``_POLL_S``), so a pointer whose save committed in
        the meantime is written and not named."""
        with self._lock:
            pending = [job for _, job, _ in self._jobs if not job.done()]
        deadline = time.monotonic() + min(_CLOSE_GRACE_S, _POLL_S * (len(pending) + 1))
        for job in pending:
            try:
                job.result(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                break
            except Exception:  # a failed write is in self._errors (raised by the next call), not unwritten
                continue
        with self._lock:
            late = {step for step, job, handle in self._jobs if not job.done() and not handle.done()}
            return sorted(self._given_up | late)

    def _timed_out(self) -> SaveTimeoutError:
        """The checkpointer's wait timed out: what did not finish (a save, or a committed save's drain)."""
        return SaveTimeoutError(after_timeout(self.checkpointer, f"within {self.timeout_s:g} s")[1])

    def _not_committed(self, step: int) -> SaveTimeoutError:
        """A load's wait for the commit of the save of ``step`` timed out."""
        outcome = WaitOutcome(step, False, None, (f"the save of step {step}",))
        within = f"within {self.timeout_s:g} s"
        return SaveTimeoutError(unfinished_message(outcome, self.checkpointer.storage.uri, within))

    def _raise_error(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise StorageError("; ".join(str(e) for e in errors)) from errors[0]

    def _committed(self) -> bool:
        """Before a save, whether the previous save has committed, so deleting may run now: waited for at most
        ``timeout_s`` with ``on_busy="wait"`` (the new save waits for it anyway), not at all otherwise.

        A drain to a later tier does not hold the deletion off: a slower tier's drain is busy nearly all the
        time, and deferring to it kept every rotated checkpoint on the first tier. ``prune`` never deletes a
        step being drained or read; the steps it keeps go back to ``self._unreferenced`` for the next try."""
        timeout = self.timeout_s if self.checkpointer.on_busy == "wait" else 0.0
        return all(handle.wait(timeout) for handle in list(self._handles.values()))

    def _delete_unreferenced(self, *, wait: bool) -> None:
        with self._lock:
            candidates = set(self._unreferenced)
        if not candidates:
            return
        if wait and not self._committed():
            return  # still in self._unreferenced: the next save or teardown deletes them
        # Held while the pointers are read and the candidates taken: a pointer write (which holds it too)
        # that replaces a step's last pointer in between would otherwise add that step back to
        # self._unreferenced just before it is taken away, and it would stay stored for good.
        with self._lock:
            pending = {step for step, job, _ in self._jobs if not job.done()}
            on_disk: set[int] = set()
            for directory in self._dirs:
                for entry in Path(directory).glob("*"):
                    try:
                        on_disk.add(read_pointer(entry))
                    except (CheckpointNotFoundError, FormatError, OSError):
                        continue
            doomed = frozenset(candidates - pending - on_disk)
            # A step named only by a pending write stays a candidate: a write to a path Lightning removed meanwhile
            # adds its step back just before its job counts as done, and this pass must not undo that.
            self._unreferenced -= doomed | (candidates & on_disk)
        if doomed:
            deleted = self.checkpointer.prune(policy=_Without(doomed))
            kept = doomed - set(deleted)
            if kept:  # e.g. a tier's newest checkpoint, which retention never deletes
                with self._lock:
                    self._unreferenced |= kept


def _metrics(checkpoint: dict[str, Any]) -> dict[str, float]:
    """``ModelCheckpoint``'s monitored scores, recorded as tiersave metrics (for ``tiersave ls`` and
    metric-based retention by hand)."""
    out: dict[str, float] = {}
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if not (isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(state, dict)):
            continue
        monitor, score = state.get("monitor"), state.get("current_score")
        if isinstance(monitor, str) and score is not None:
            try:
                value = float(score)
            except (TypeError, ValueError):
                continue
            if math.isfinite(value) and _METRIC_RE.match(monitor):
                out.setdefault(monitor, value)
    return out
