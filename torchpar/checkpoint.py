"""torch.distributed.checkpoint (DCP) for the ddp, fsdp and single-process backends.

<run.dir>/checkpoints/<step>/ holds the model and AdamW state as DCP writes them (one shard file
per rank plus .metadata) and meta.json (step = the data-iterator state, backend, world size).
DCP reshards on load, so a checkpoint saved by N ranks (FSDP2 DTensors or DDP replicas) loads on
any number of ranks and into any of these backends. Each save goes to `<step>.partial` and is
renamed when every rank has finished, so a process killed mid-save leaves the previous one; a save that
fails (a full disk) is removed and stops the run with one line naming the step and the last complete
checkpoint, and partial saves an earlier process left are removed when the next one starts.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import warnings
from contextlib import contextmanager

import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from jaxpar.core.errors import UserError, error_line
from jaxpar.core.run.directory import foreign_checkpoint
from torchpar import dist
from torchpar.diloco import check_saved_groups
from torchpar.dist import Env


# Optimizer hyperparameters stored per parameter name: pipeline stages hold different parameters, and a
# single "param_groups" entry would be saved by one rank only and loaded into every rank.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@contextmanager
def _single_process_ok():
    """DCP warns when used without a process group even when told so (no_dist); the one-process backend is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def complete_steps(ckpt_dir: str) -> list[int]:
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(
        int(d) for d in os.listdir(ckpt_dir) if d.isdigit() and os.path.exists(os.path.join(ckpt_dir, d, "meta.json"))
    )


def filesystem_failure(e: BaseException, where: str) -> str | None:
    """What the system said when a write under `where` failed, or None (not a filesystem failure).

    torch.save's zip writer turns a failed write into a RuntimeError ('unexpected pos', after an 'iostream error'
    under DeepSpeed) whose chain may not hold the OSError; nor does DCP's gather of the ranks' errors keep it.
    """
    chain = []
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    os_error = next((x for x in chain if isinstance(x, OSError)), None)
    if os_error is not None:
        return error_line(os_error)
    if any(isinstance(x, RuntimeError) and ("unexpected pos" in str(x) or "iostream error" in str(x)) for x in chain):
        free = shutil.disk_usage(where).free
        return os.strerror(errno.ENOSPC) if not free else f"a write came short ({free:,} bytes free there)"
    return None


@contextmanager
def failing_save(step: int, partial: str, is_main: bool, last_complete):
    """Turn a save into `partial` that fails on the filesystem into one UserError, the partial save removed.

    DCP gathers every rank's error into one CheckpointException, raised on every rank. `partial` is removed, then one
    UserError names the step and `last_complete()`, the newest complete step (None: none). Any other error is a bug
    and keeps its traceback.
    """
    try:
        yield
    except (Exception, CheckpointException) as e:
        errors = [err for err, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
        where = os.path.dirname(partial)
        reasons = {filesystem_failure(err, where) for err in errors} - {None}
        if not reasons:
            raise
        if is_main:
            shutil.rmtree(partial, ignore_errors=True)
        last = last_complete()
        last = (
            f"the last complete checkpoint is step {last} in {where}"
            if last is not None
            else f"there is no complete checkpoint in {where} yet"
        )
        raise UserError(
            f"the checkpoint of step {step} could not be written: {'; '.join(sorted(reasons))}; "
            f"its partial files were removed; {last}"
        ) from None


class DCPCheckpointer:
    def __init__(self, run_dir: str, keep: int, model, optimizer, env: Env):
        self.dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.keep, self.model, self.optimizer, self.env = keep, model, optimizer, env
        self.rank_state = None  # each rank's own state beside DCP's (save(folder), load(folder)): DDP's PowerSGD
        self.views = None  # views(state) / unviews(state): what DCP sees (ddp's split experts, DiLoCo's groups)
        self.groups = 1  # DiLoCo's groups (torchpar/diloco.py): a checkpoint of another number is refused
        self.own: set[int] = set()  # steps this run saved or restored: the only ones a save may find on disk

    def remove_partial_saves(self) -> None:
        """The trainer, before its first restore.

        A `<step>.partial` is a save its run did not finish (killed, disk full). Not for readers (generate): a
        live run's save in flight looks the same.
        """
        if self.env.is_main and os.path.isdir(self.dir):
            for name in os.listdir(self.dir):
                if name.endswith(".partial"):
                    shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=FLAT)
        state = {"model": model_sd, "optim": optim_sd}
        return state if self.views is None else self.views.views(state)

    def save(self, step: int, meta: dict) -> None:
        """A DCP checkpoint of `step`.

        Done already if this run saved or restored it (the final save right after a periodic one); a step on disk that
        is not this run's is refused.
        """
        final = os.path.join(self.dir, str(step))
        if step in self.own:
            return
        if os.path.exists(final):
            raise foreign_checkpoint(self.dir, step)
        tmp = final + ".partial"
        if self.env.is_main and os.path.exists(tmp):
            shutil.rmtree(tmp)
        dist.barrier()
        with failing_save(step, tmp, self.env.is_main, self._last_complete), _single_process_ok():
            dcp.save(self._state(), checkpoint_id=tmp, no_dist=not tdist.is_initialized())
            if self.rank_state is not None:
                self._save_rank_state(tmp)
        dist.barrier()
        if self.env.is_main:
            with failing_save(step, tmp, self.env.is_main, self._last_complete):
                with open(os.path.join(tmp, "meta.json"), "w") as f:
                    json.dump(meta, f)
                os.replace(tmp, final)
            for old in complete_steps(self.dir)[: -self.keep]:
                shutil.rmtree(os.path.join(self.dir, str(old)), ignore_errors=True)
        dist.barrier()
        self.own.add(step)

    def _save_rank_state(self, folder: str) -> None:
        """Every rank's own file, or a failure on every rank (no rank waits at the next barrier for one that stopped).

        The failing rank's error, or an OSError naming another rank's.
        """
        error = None
        try:
            self.rank_state.save(folder)
        except Exception as e:  # noqa: BLE001 - failing_save tells a full disk from a bug
            error = e
        if dist.any_rank(error is not None, self.env):
            raise error or OSError(errno.EIO, "another rank could not write its part of the checkpoint", folder)

    def _last_complete(self) -> int | None:
        return (complete_steps(self.dir) or [None])[-1]

    def restore(self, params_only: bool = False) -> dict | None:
        """meta of the newest checkpoint, loaded into model and optimizer; None if there is none.

        `params_only` (readers of the parameters): the model alone, a DiLoCo run's synchronised parameters included.
        """
        steps = complete_steps(self.dir)
        if not steps:
            if os.path.exists(os.path.join(self.dir, "latest")):
                raise UserError(
                    f"{self.dir} holds DeepSpeed checkpoints; resume with --backend deepspeed or start a new run.dir"
                )
            return None
        path = os.path.join(self.dir, str(steps[-1]))
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if not params_only:
            check_saved_groups(meta, self.groups, path)
        state = self._state()
        if params_only:
            state = {"model": state["model"]}
        try:
            with _single_process_ok():
                dcp.load(state, checkpoint_id=path, no_dist=not tdist.is_initialized())
        except Exception as e:  # noqa: BLE001 - any failure to read is a checkpoint problem for the user
            reason = (str(e).strip().splitlines() or [repr(e)])[0][:300]
            raise UserError(f"checkpoint {path} could not be loaded: {reason}") from None
        if params_only:
            set_model_state_dict(self.model, state["model"], options=FLAT)
            return meta
        if self.views is not None:
            state = self.views.unviews(state)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT
        )
        if self.rank_state is not None:
            self.rank_state.load(path)
        self.own.add(steps[-1])
        if self.env.is_main:
            print(f"resumed from {path}", file=sys.stderr)
        return meta
