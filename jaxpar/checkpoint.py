"""orbax checkpoints in <run.dir>/checkpoints: save every N steps, keep K, resume from the latest.

Saves are asynchronous: `save` returns once the arrays are copied off the devices, and orbax writes them on
a background thread while training goes on (a second save, a restore and `close` wait for the one in flight).
orbax writes each step to a temporary directory and renames it when complete, so a process killed mid-save
leaves the last complete one. Restoring reads into the *current* layout's shardings, so a checkpoint written
on one mesh loads on another. A step directory that fails to load is renamed `<step>.unreadable` (kept for
inspection, never deleted) and the previous one is tried.

A save that fails (a full disk, a lost permission) stops the run with one line naming the step and the last
complete checkpoint; its partial directory is removed (and any left by an earlier process, when the manager
opens), so a resume after freeing space continues from that checkpoint. Without run.debug, orbax's own log
records are hidden: a failed save logs the same error from several threads, each with a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import time
import traceback

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpar.core.errors import UserError, os_error_line
from jaxpar.core.run.directory import foreign_checkpoint, step_dirs

_TMP = ".orbax-checkpoint-tmp"  # orbax writes step N to N.orbax-checkpoint-tmp[-...] and renames it when complete


class _HideOrbaxLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:  # orbax's own records, and asyncio's about orbax's futures
        where = record.pathname + record.getMessage()
        if record.exc_info and record.exc_info[2]:
            where += " ".join(frame.filename for frame in traceback.extract_tb(record.exc_info[2]))
        return "orbax" not in where


def _orbax_noise(unraisable) -> bool:
    """Whether an unraisable exception is orbax's harmless noise after a failed save.

    After a failed write, tensorstore completes the other writes' futures on orbax's event loop, closed by then (each
    prints 'Event loop is closed'), and orbax's unfinished coroutines are collected at exit.
    """
    e, where = unraisable.exc_value, repr(unraisable.object)
    return (isinstance(e, RuntimeError) and str(e) == "Event loop is closed") or "orbax" in where


def _hide_orbax_logs() -> None:
    """Unless run.debug raised absl's verbosity to INFO (jaxpar.train.show_library_logs), drop what orbax prints.

    Its log records (absl), its tasks' (asyncio's) and the exceptions it leaves unraisable.
    """
    absl = logging.getLogger("absl")
    if absl.getEffectiveLevel() <= logging.INFO or any(isinstance(f, _HideOrbaxLogs) for f in absl.filters):
        return
    absl.addFilter(_HideOrbaxLogs())
    logging.getLogger("asyncio").addFilter(_HideOrbaxLogs())
    previous = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None if _orbax_noise(unraisable) else previous(unraisable)


def save_failure(e: BaseException) -> str | None:
    """What the system said when a save failed on the filesystem, or None when `e` is not such a failure.

    tensorstore reports an OS error inside a ValueError's text (`... [os_error_code='28']`).
    """
    if isinstance(e, OSError):
        return os_error_line(e)
    code = re.search(r"os_error_code='?(\d+)", str(e))
    return os.strerror(int(code.group(1))) if code else None


class Checkpointer:
    def __init__(self, run_dir: str, keep: int, asynchronous: bool = True, trainer: bool = False):
        """asynchronous=False: what a blocking save costs.

        Trainer=True: the run's own trainer, which removes saves an earlier process left unfinished (a reader,
        such as generate, must not: a live run's save in flight looks the same).
        """
        self.dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.keep, self.asynchronous, self.last = keep, asynchronous, None  # last: saved or being saved
        self.own: set[int] = set()  # steps this run saved or restored: the only ones a save may find on disk
        self.trainer = trainer
        self.failed = False  # a save failed: no more saves, close() only releases the manager
        _hide_orbax_logs()
        self._open()

    def _open(self):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep,
            create=True,
            cleanup_tmp_directories=self.trainer,
            enable_async_checkpointing=self.asynchronous,
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}  # item_metadata
        self.manager = ocp.CheckpointManager(self.dir, item_handlers=handlers, options=options)

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `step`.

        A no-op if this run saved or restored it already (the final save right after a periodic one). A step on disk
        that is not this run's is refused, and so is any save after a failed one.
        """
        if self.failed:
            raise UserError(f"a checkpoint save in {self.dir} failed earlier in this run: step {step} is not saved")
        if step in self.own:
            return
        if step in self.manager.all_steps():
            raise foreign_checkpoint(self.dir, step)
        with self._failing_save(step):  # also the previous step's asynchronous save: this call waits for it
            self.manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            )
        self.last = step
        self.own.add(step)

    def wait(self) -> None:
        """Until the save in flight, if any, is complete on disk."""
        if not self.failed:
            with self._failing_save(None):
                self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _failing_save(self, step: int | None):
        """Turn a failing save into one UserError, after removing its partial directory.

        The error names the failed step and the last complete checkpoint. An error that is no filesystem failure
        keeps its traceback (a bug).
        """
        try:
            yield
        except Exception as e:
            self.failed = True
            complete = self._complete_steps()
            failed = self.last if self.last is not None and self.last not in complete else step
            self._remove_partial()
            reason = save_failure(e)
            if reason is None:
                raise
            last = (
                f"the last complete checkpoint is step {complete[-1]} in {self.dir}"
                if complete
                else f"there is no complete checkpoint in {self.dir} yet"
            )
            raise UserError(
                f"the checkpoint of step {failed} could not be written: {reason}; its partial files "
                f"were removed; {last}"
            ) from None

    def _complete_steps(self) -> list[int]:
        """Step directories orbax has finished (renamed from their temporary name), read from disk."""
        return step_dirs(self.dir)

    def _remove_partial(self) -> None:
        """The failed step's temporary directory.

        tensorstore goes on for a moment with the writes orbax gave up on, on threads of its own, and may make
        their directories again: remove until none came back for 0.5 s.
        """
        if jax.process_index() != 0:
            return
        t0 = quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 0.5 and time.monotonic() - t0 < 10:
            left = [n for n in os.listdir(self.dir) if _TMP in n] if os.path.isdir(self.dir) else []
            for name in left:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)
            quiet_since = time.monotonic() if left else quiet_since
            time.sleep(0.05)

    def newest_tree(self):
        """The newest checkpoint's tree of saved arrays (shapes, dtypes), or None: no checkpoint, or unreadable."""
        self.wait()
        steps = self.manager.all_steps()
        try:
            return self.manager.item_metadata(max(steps))["state"].tree if steps else None
        except Exception:  # noqa: BLE001 - unreadable: restore_latest says so, and tries the older ones
            return None

    def restore_latest(self, abstract_state, fit=None):
        """(state, meta) from the newest loadable checkpoint, or None if there is none at all.

        `fit`: the saved state's metadata tree -> (what to read instead of `abstract_state`, a function of what
        was read, or None) -- parts of the state that depend on the layout they were saved on (jaxpar/state.py:
        restore_latest).

        Newer checkpoints that fail to load are set aside only once an older one has loaded, so
        that new saves cannot collide with them; if none loads, nothing is touched and we stop.
        """
        self.wait()
        failures = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                target, after = fit(self.manager.item_metadata(step)["state"].tree) if fit else (abstract_state, None)
                out = self.manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
                )
            except Exception as e:  # noqa: BLE001 - any failure to read means: try the previous one
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                failures.append((step, reason))
                print(f"warning: checkpoint {self.dir}/{step} failed to load: {reason}", file=sys.stderr)
                continue
            for bad, _ in failures:
                self._set_aside(bad)
            self.own.add(step)
            # fitted after the read: a failure here is not the checkpoint's, and sets nothing aside
            return (after(out["state"]) if after is not None else out["state"]), dict(out["meta"])
        if failures:
            detail = "; ".join(f"step {s}: {r}" for s, r in failures)
            raise UserError(f"no checkpoint in {self.dir} could be loaded ({detail})")
        return None

    def _set_aside(self, step: int) -> None:
        if jax.process_index() == 0:
            src = os.path.join(self.dir, str(step))
            dst = f"{src}.unreadable"
            n = 1
            while os.path.exists(dst):
                dst, n = f"{src}.unreadable{n}", n + 1
            os.rename(src, dst)
            print(f"warning: set {src} aside as {dst}", file=sys.stderr)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"set_aside_{step}")
        self.manager.close()
        self._open()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 - after a failed save, closing re-raises its error: said already
                if not self.failed:
                    raise


def abstract_like(state, shardings):
    """ShapeDtypeStructs carrying the target shardings: what a restore should produce."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
