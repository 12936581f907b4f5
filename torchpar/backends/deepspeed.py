"""DeepSpeed ZeRO 0-3: the DeepSpeed JSON is generated from the shared config.

A user's JSON (--deepspeed-config) is merged on top and wins wherever it speaks; rank 0 prints the result.

Generated: batch sizes and accumulation from train.*, ZeRO stage from parallel.zero_stage,
torch AdamW (`torch_adam`, no op builds) with optim.*, gradient_clipping, bf16 / fp16 from
model.compute_dtype (fp16: dynamic loss scaling from optim.loss_scale_*), communication_data_type bf16 from
parallel.grad_compression=bf16, CPU offload of the optimizer
(parallel.offload=optimizer) and of parameters too (params+optimizer, stage 3).
The user JSON may not contradict the shared keys where the model depends on them: precision sections
other than model.compute_dtype's and an `activation_checkpointing` section (torchpar/parallelize.py recomputes
the blocks through torch.utils.checkpoint by model.remat; model.remat=offload generates the section itself:
DeepSpeed's checkpointing of each block with its input on the host, `cpu_checkpointing`) are refused.
The learning rate follows jaxpar's warmup + cosine (torchpar.optim.SharedLRSchedule) unless the
user JSON names a "scheduler". Checkpoints are DeepSpeed's own (save_checkpoint/load_checkpoint,
tag = step, client_state = the step), in <run.dir>/checkpoints.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import shutil
import sys
import warnings

import torch

from jaxpar.core.errors import UserError
from jaxpar.core.optimizer.lr_schedule import lr_at
from jaxpar.core.run.directory import foreign_checkpoint, step_dirs
from torchpar import dist
from torchpar.backends.base import add_stats, eval_loss, microbatch_loss, microbatches, mtp_share, read_metrics
from torchpar.backends.deepspeed_universal import forget, quiet_universal_load, repair_zero3_load, universal_source
from torchpar.checkpoint import complete_steps, failing_save
from torchpar.optim import SharedLRSchedule, group_settings, param_groups, put_back


def import_deepspeed():
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # deferred: deepspeed, optional: --backend deepspeed only
    except ImportError as e:
        raise UserError(f"--backend deepspeed needs the deepspeed package (pip install deepspeed): {e}") from None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's ZeRO calls torch APIs that torch has deprecated; that is not the user's to fix.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    return deepspeed


def quiet_comm_init(deepspeed) -> None:
    """Set up DeepSpeed's communication layer over torchpar's process group, its start-up message silenced.

    deepspeed.initialize then reuses it. It is set up here because it prints
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" on every rank at every start (it loads, or
    first builds, its shared-memory op on CPU): not for the console.
    """
    from deepspeed.accelerator import get_accelerator  # deferred: deepspeed, optional: --backend deepspeed only

    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.comm.init_distributed(
            dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False
        )


def fp16_section(cfg) -> dict:
    """DeepSpeed's dynamic loss scaler from the shared keys; its factors are fixed at 2 (x2 / x0.5)."""
    o = cfg.optim
    power = math.log2(o.loss_scale_init)
    if (o.loss_scale_growth_factor, o.loss_scale_backoff_factor) != (2.0, 0.5) or power != int(power):
        raise UserError(
            "DeepSpeed's loss scaler grows x2 and backs off x0.5 from a power of two: set "
            "optim.loss_scale_growth_factor=2, optim.loss_scale_backoff_factor=0.5 and a power-of-two "
            f"optim.loss_scale_init (not {o.loss_scale_init:g})"
        )
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": int(power),
        "hysteresis": 1,
        "loss_scale_window": o.loss_scale_growth_interval,
        "min_loss_scale": o.loss_scale_min,
    }


def generated_config(cfg, world: int) -> dict:
    t, o, stage = cfg.train, cfg.optim, cfg.parallel.zero_stage
    zero = {"stage": stage}
    if cfg.parallel.offload != "none":  # torchpar.checks.check_offload: stage >= 1, params only at 3
        zero["offload_optimizer"] = {"device": "cpu"}
        if cfg.parallel.offload == "params+optimizer":
            zero["offload_param"] = {"device": "cpu"}
    dtype = cfg.model.compute_dtype
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.global_batch_size // t.microbatches // world,
        "gradient_accumulation_steps": t.microbatches,
        "gradient_clipping": o.grad_clip,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW also with offload: no C++ op build needed
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": lr_at(0, o, t.steps),
                "betas": [o.beta1, o.beta2],
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                "torch_adam": True,
            },
        },
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": fp16_section(cfg) if dtype == "float16" else {"enabled": False},
        "steps_per_print": 2**31 - 1,
        **({"communication_data_type": "bf16"} if cfg.parallel.grad_compression == "bf16" else {}),
        **({"activation_checkpointing": OFFLOAD_CHECKPOINTING} if cfg.model.remat == "offload" else {}),
    }


# model.remat=offload: each block's input copied to the host and the block recomputed in the backward pass
# (torchpar/parallelize.py calls deepspeed.checkpointing.checkpoint). DeepSpeed documents cpu_checkpointing as
# working with partition_activations only (without it, on a CPU device its "copy" to the host is the input itself,
# which it then empties); with no model parallelism the partition is the whole input: nothing moves between ranks
OFFLOAD_CHECKPOINTING = {"partition_activations": True, "cpu_checkpointing": True}


def merge(base: dict, user: dict) -> dict:
    """Deep merge: the user's values win; nested sections are merged key by key."""
    out = dict(base)
    for key, value in user.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_user_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"DeepSpeed config not found: {path}")
    try:
        with open(path) as f:
            user = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
    if not isinstance(user, dict):
        raise UserError(f"DeepSpeed config {path}: top level must be an object")
    return user


class DeepSpeedEngine:
    """The `Engine` (torchpar/backends/__init__.py) over DeepSpeed's: its step, loss scaler and checkpoints."""

    local_params = optimizer_bytes = None  # ZeRO's partitions are DeepSpeed's own business
    groups = None  # DiLoCo's groups run on ddp and fsdp (jaxpar/core/config/mesh_spec.py TORCH_MESH_AXES)

    def __init__(self, engine, cfg, env, config: dict, universal: str | None = None):
        self.engine = self.module = engine
        self.universal = universal  # resume from this universal copy (deepspeed_universal.py), once
        self.raw = engine.module
        self.cfg, self.env, self.config = cfg, env, config
        self.stage = config.get("zero_optimization", {}).get("stage", 0)
        self.dir = os.path.abspath(os.path.join(cfg.run.dir, "checkpoints"))
        self.data_rank, self.data_ways = env.rank, env.world
        self.own: set[int] = set()  # steps this run saved or restored: the only ones a save may find on disk

    def eval_loss(self, batch: torch.Tensor, share: float = 1.0) -> float:
        return eval_loss(self.module, batch, share)

    def read(self, handle) -> dict:
        return read_metrics(handle, self.env, self.data_ways, self.cfg.model.moe_experts)

    def inject_overflow(self) -> None:
        raise UserError("TORCHPAR_FAULT_OVERFLOW_AT_STEP (a test fault) is not implemented for --backend deepspeed")

    def update(self, batch: torch.Tensor, share: float = 1.0):
        micro = microbatches(batch, self.cfg.train.microbatches)
        lr = self.engine.get_lr()[0]
        total, norm, experts, depths = torch.zeros((), device=self.env.device), None, None, None
        for m, batch in enumerate(micro):
            loss, stats = microbatch_loss(self.engine, self.engine.module, batch)
            loss = loss * share
            experts = add_stats(experts, stats)
            depths = add_stats(depths, mtp_share(self.engine.module, share / len(micro)))
            self.engine.backward(loss)  # DeepSpeed scales by 1/accumulation and reduces at the boundary
            if m == len(micro) - 1 and self.stage == 0 and not self.engine.fp16_enabled():
                grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads)  # ZeRO-0 fp32 keeps no norm of its own
            self.engine.step()
            total += loss.detach() / len(micro)
        ds_norm = self.engine.get_global_grad_norm()
        norm = ds_norm if ds_norm is not None else norm
        extra = {}
        if self.engine.fp16_enabled():  # DeepSpeed's own loss scaler (generated from optim.loss_scale_*)
            extra = {
                "loss_scale": float(getattr(self.engine.optimizer, "cur_scale", float("nan"))),
                "skipped_steps": int(self.engine.skipped_steps),
            }
        if experts is not None:
            extra["expert_stats"] = experts
        if depths is not None:
            extra["mtp_losses"] = depths
        return total, torch.as_tensor(float("nan") if norm is None else float(norm)), lr, extra

    def full_state_dict(self) -> dict:
        """Whole fp32 weights by torch name.

        The optimizer's fp32 master copy (gathered over ranks, a collective) at ZeRO 1-3 or with bf16; the
        parameters themselves where there is no such copy.
        """
        from deepspeed.utils import safe_get_full_fp32_param  # deferred: deepspeed, optional: --backend deepspeed only

        out = {}
        for name, p in self.engine.module.named_parameters():
            full = safe_get_full_fp32_param(p)
            out[name] = (p if full is None else full).detach().float().cpu()
        return out

    def latest(self) -> int | None:
        """The newest complete checkpoint: DeepSpeed writes the `latest` tag file after every rank's files."""
        try:
            with open(os.path.join(self.dir, "latest")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def remove_partial_saves(self) -> None:
        """The trainer, before its first restore.

        Step directories newer than `latest` are saves a process did not finish (killed, disk full). Nothing
        without a readable `latest` (another backend's run, or none).
        """
        latest = self.latest()
        if latest is not None and self.env.is_main:
            for name in os.listdir(self.dir):
                if name.isdigit() and int(name) > latest:
                    shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def save(self, step: int, meta: dict) -> None:
        """DeepSpeed's checkpoint of `step`.

        Done already if this run saved or restored it (the final save right after a periodic one); a complete step on
        disk that is not this run's is refused. DeepSpeed writes into the step's folder itself: one past `latest` (or
        with no `latest` yet) is a save a killed process left unfinished, written again.
        """
        if step in self.own:
            return
        latest = self.latest()
        if os.path.exists(os.path.join(self.dir, str(step))) and latest is not None and step <= latest:
            raise foreign_checkpoint(self.dir, step)
        with failing_save(step, os.path.join(self.dir, str(step)), self.env.is_main, self.latest):
            self.engine.save_checkpoint(self.dir, tag=str(step), client_state=meta)
        dist.barrier()
        if self.env.is_main:
            for old in step_dirs(self.dir)[: -self.cfg.checkpoint.keep]:
                shutil.rmtree(os.path.join(self.dir, str(old)), ignore_errors=True)
        dist.barrier()
        self.own.add(step)

    def release(self) -> None:
        """Before the process groups are destroyed (torchpar.dist.teardown).

        Let go of them, so that they are freed then. destroy() removes the engine's hooks (ZeRO-3's asks
        DeepSpeed's communication for the rank, so it runs before release_deepspeed_groups); ZeRO-3 also keeps
        the model (whose parameters name a group) in two globals for good.
        """
        self.engine.destroy()
        forget_module(self.engine.module)

    def restore(self) -> int | None:
        """The latest complete checkpoint (partial saves removed first); its data step, or None."""
        self.remove_partial_saves()
        meta = self.load()
        return None if meta is None else int(meta["data_step"])

    def load(self) -> dict | None:
        if not os.path.exists(os.path.join(self.dir, "latest")):
            if complete_steps(self.dir):
                raise UserError(
                    f"{self.dir} holds torch.distributed.checkpoint checkpoints (ddp/fsdp/none); "
                    "resume with one of those backends or start a new run.dir"
                )
            return None
        settings = config_settings(self.engine.optimizer)
        with quiet_universal_load(bool(self.universal)):
            path, client_state = self.engine.load_checkpoint(self.universal or self.dir)
        if path is None:
            raise UserError(f"DeepSpeed checkpoint in {self.universal or self.dir} could not be loaded")
        put_back_settings(self.engine, settings)
        if "step" in client_state:
            self.own.add(int(client_state["step"]))
        if self.universal:
            if self.stage == 3:
                repair_zero3_load(self.engine.optimizer)
            forget(self.universal, self.env)
            self.universal = None
        if self.env.is_main:
            print(f"resumed from {path}", file=sys.stderr)
        return client_state


# The dynamic loss scaler's rules (DeepSpeed's DynamicLossScaler at ZeRO 1-3, the LossScaleConfig of its fp16
# wrapper at stage 0): its scale and counters are state, these are the config's
SCALER_RULES = (
    "scale_factor",
    "scale_window",
    "min_scale",
    "min_loss_scale",
    "delayed_shift",
    "consecutive_hysteresis",
    "raise_error_at_min_scale",
)


def _scaler(optimizer):
    return getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)


def config_settings(optimizer) -> dict:
    """The settings that the config decides but load_checkpoint would overwrite from the checkpoint.

    The engine was built from the config: every parameter group's settings (lr aside), the clipping threshold
    (ZeRO 1-2, the fp16/bf16 wrappers keep it), the loss scaler's rules (ZeRO 1-3 unpickle the saved scaler whole).
    """
    scaler = _scaler(optimizer)
    return {
        "groups": group_settings(getattr(optimizer, "optimizer", optimizer)),
        "clip_grad": getattr(optimizer, "clip_grad", None),
        "scaler": {k: getattr(scaler, k) for k in SCALER_RULES if hasattr(scaler, k)},
    }


def put_back_settings(engine, settings: dict) -> None:
    """After load_checkpoint.

    The config's settings again, and the lr of the shared schedule at its restored position under this config (the
    restored groups carry the lr the saved run's schedule had set).
    """
    optimizer = engine.optimizer
    put_back(getattr(optimizer, "optimizer", optimizer), settings["groups"])
    if settings["clip_grad"] is not None:
        optimizer.clip_grad = settings["clip_grad"]
    scaler = _scaler(optimizer)
    for k, v in settings["scaler"].items():
        setattr(scaler, k, v)
    if isinstance(engine.lr_scheduler, SharedLRSchedule):
        engine.lr_scheduler.apply()


def forget_module(module) -> None:
    """DeepSpeed 0.19's ZeRO-3 holds a model after engine.destroy().

    On its forward-module stack (the root module is pushed at setup and never popped) and, with its submodules, as
    keys of a class-level cache of the parameter coordinator (functools.lru_cache on a method). Both let go of it
    here.
    """
    from deepspeed.runtime.zero import parameter_offload  # deferred: deepspeed, optional: --backend deepspeed only
    from deepspeed.runtime.zero.partitioned_param_coordinator import (  # deferred: deepspeed, optional
        PartitionedParameterCoordinator,
    )

    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [m for m in stack if m is not module]
    method = vars(PartitionedParameterCoordinator)["_PartitionedParameterCoordinator__params_to_release"]
    for cell in method.__closure__ or ():  # the lru_cache under DeepSpeed's nvtx wrapper
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def check_user_config(user: dict, cfg) -> None:
    """Sections of a user JSON that would contradict what the model does: one line each."""
    if "activation_checkpointing" in user:
        raise UserError(
            "the DeepSpeed config's activation_checkpointing section would do nothing here: torchpar "
            "recomputes blocks by model.remat (none|full|save_matmuls|offload, which sets the section's "
            "cpu_checkpointing); set that key instead"
        )
    wire = user.get("communication_data_type")
    if cfg.parallel.grad_compression == "bf16" and wire not in (None, "bf16"):
        raise UserError(
            f"the DeepSpeed config sets communication_data_type={wire!r}, but "
            "parallel.grad_compression=bf16 asks for bf16: leave one of them out"
        )
    for key, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        if user.get(key, {}).get("enabled") and cfg.model.compute_dtype != dtype:
            raise UserError(
                f"the DeepSpeed config enables {key}, but model.compute_dtype={cfg.model.compute_dtype}: "
                f"set model.compute_dtype={dtype} (loss scaling: optim.loss_scale_*)"
            )


def check_deepspeed(cfg, deepspeed_config: str) -> None:
    """What torchpar.train checks before any process group.

    DeepSpeed importable, float16 possible here, the user JSON readable and consistent with the shared keys.
    """
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator  # deferred: deepspeed, optional: --backend deepspeed only

    if cfg.model.compute_dtype == "float16":
        fp16_section(cfg)
        if not get_accelerator().is_fp16_supported():
            raise UserError(
                f"DeepSpeed's {get_accelerator().device_name()} accelerator has no float16 support on "
                "this machine: use model.compute_dtype=bfloat16, or another backend for float16"
            )
    if deepspeed_config:
        check_user_config(load_user_config(deepspeed_config), cfg)


def build(model, cfg, env, deepspeed_config: str = "", **_):
    deepspeed = import_deepspeed()
    config = generated_config(cfg, env.world)
    if deepspeed_config:
        config = merge(config, load_user_config(deepspeed_config))
    if env.is_main:
        print("deepspeed config: " + json.dumps(config, sort_keys=True), flush=True)
    if config.get("fp16", {}).get("enabled"):
        model.compute_dtype = torch.float16
    elif config.get("bf16", {}).get("enabled"):
        model.compute_dtype = torch.bfloat16
    else:
        model.compute_dtype = torch.float32
    # the last checkpoint came from another number of ranks (the stage: a user JSON's may differ from the key's)
    universal = universal_source(cfg, env, int(config.get("zero_optimization", {}).get("stage", 0)))
    if universal:
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
    scheduler = None if "scheduler" in config else (lambda opt: SharedLRSchedule(opt, cfg))
    quiet_comm_init(deepspeed)
    try:
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, cfg.optim.weight_decay),
            config=config,
            lr_scheduler=scheduler,
            dist_init_required=False,
        )
    except AssertionError as e:  # DeepSpeed validates its config with asserts
        raise UserError(f"DeepSpeed rejected the config: {e}") from None
    if "activation_checkpointing" in config:  # model.remat=offload: read by deepspeed.checkpointing.checkpoint
        deepspeed.checkpointing.configure(None, deepspeed_config=config)
    wrapper = DeepSpeedEngine(engine, cfg, env, config, universal)
    dist.before_teardown(release_deepspeed_groups)  # registered once, so it runs after every engine's release
    dist.before_teardown(wrapper.release)
    return wrapper


def release_deepspeed_groups() -> None:
    """Empty DeepSpeed's group registry with its destroy_process_group.

    This is teardown's last DeepSpeed release: in a process that built two engines
    (tests/torchpar/chunked_loss_ranks.py), the second engine's destroy fails after it.
    """
    import_deepspeed().comm.destroy_process_group()
