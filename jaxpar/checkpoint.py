"""orbax checkpoints in <run.dir>/checkpoints: save every N steps, keep K, resume from the latest.

Saves are asynchronous: `save` returns once the arrays are copied off the devices, and orbax writes them on
a background thread while training goes on (a second save, a restore and `close` wait for the one in flight).
orbax writes each step to a temporary directory and renames it when complete, so a process killed mid-save
leaves the last complete one. Restoring reads into the *current* layout's shardings, so a checkpoint written
on one mesh loads on another. A step directory that fails to load is renamed `<step>.unreadable` (kept for
inspection, never deleted) and the previous one is tried.
"""
from __future__ import annotations

import os
import sys

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpar.core.errors import UserError


class Checkpointer:
    def __init__(self, run_dir: str, keep: int, asynchronous: bool = True):  # False: what a blocking save costs
        self.dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.keep, self.asynchronous, self.last = keep, asynchronous, None  # last: saved or being saved
        self._open()

    def _open(self):
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                               enable_async_checkpointing=self.asynchronous)
        self.manager = ocp.CheckpointManager(self.dir, options=options)

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `step` (a no-op if it is saved or being saved already: the final save right after a
        periodic one)."""
        if step == self.last or step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          meta=ocp.args.JsonSave(meta)))
        self.last = step

    def wait(self) -> None:
        """Until the save in flight, if any, is complete on disk."""
        self.manager.wait_until_finished()

    def restore_latest(self, abstract_state):
        """(state, meta) from the newest loadable checkpoint, or None if there is none at all.

        Newer checkpoints that fail to load are set aside only once an older one has loaded, so
        that new saves cannot collide with them; if none loads, nothing is touched and we stop.
        """
        self.wait()
        failures = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - any failure to read means: try the previous one
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                failures.append((step, reason))
                print(f"warning: checkpoint {self.dir}/{step} failed to load: {reason}", file=sys.stderr)
                continue
            for bad, _ in failures:
                self._set_aside(bad)
            return out["state"], dict(out["meta"])
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
        self.wait()
        self.manager.close()


def abstract_like(state, shardings):
    """ShapeDtypeStructs carrying the target shardings: what a restore should produce."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
