"""torchpar's adapter for the shared run (jaxpar/core/run/loop.py, the `Trainer` it drives) and its collaborators.

The plain Decoder made parallel by torchpar/parallelize.py into a backend's engine (its whole step), this rank's rows
of each batch read ahead, evaluation, sampling, saves; the collectives the run needs, the measurements, the profiler
and the test faults (jaxpar/core/run/adapter.py).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed

from jaxpar.core.config.schema import Config
from jaxpar.core.errors import UserError
from jaxpar.core.data.order import GlobalBatches, unmasked
from jaxpar.core.model.flops import optimizer_phrase, params_phrase, peak_flops
from jaxpar.core.run.hooks import sample_lengths
from jaxpar.core.data.prefetch import Prefetch
from jaxpar.core.data.tokens import document_token
from jaxpar.core.weights.names import load_weights, save_weights, unflatten
from torchpar import dist
from torchpar.comm import CommTrace, axis_sizes
from torchpar.models.decoder import Decoder
from torchpar.torchft_groups import TorchftGroups
from torchpar.parallelize import parallelize
from torchpar.weights import from_shared, shared_shapes, to_shared
from torchpar.decode import generate


def build_model(cfg: Config) -> Decoder:
    """The initial model: model.init_from's weights, else the seed's random initialisation."""
    model = Decoder(cfg.model, document_token(cfg))
    model.init_weights(cfg.train.seed)
    if cfg.model.init_from:
        model.load_state_dict(
            from_shared(load_weights(cfg.model.init_from, shared_shapes(cfg.model)), cfg.model.n_layer)
        )
    return model


class TorchTrainer:
    """The run on one backend's engine over the plain Decoder, on this process's rank of the group."""

    processes: TorchProcesses
    probes: TorchProbes
    profiling: TorchProfiling
    faults: TorchFaults

    def __init__(self, cfg: Config, backend: str, deepspeed_config: str, env, data, torchft=None):
        self.cfg, self.backend, self.deepspeed_config, self.env = cfg, backend, deepspeed_config, env
        self.torchft = torchft  # torchft's mode: (this launch's group, the group count) (torchpar/torchft_groups.py)
        self.train_data, self.val_data = data or (None, None)  # read straight from the memmap, in the shared order
        self.is_main, self.process_count, self.rank = env.is_main, env.world, env.rank
        self.engine, self.prefetch = None, None
        self.processes, self.probes = TorchProcesses(env), TorchProbes(self)
        self.profiling, self.faults = TorchProfiling(cfg, backend, env), TorchFaults(self)
        self.model = build_model(cfg)  # before run.dir is touched: a weights file that fails moves nothing

    # the run sequence
    def restore_or_init(self) -> int:
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.engine, self.compiled = parallelize(self.model, self.cfg, self.env, self.backend, self.deepspeed_config)
        if self.torchft is not None:  # its checkpoints say their group count (engine.save)
            self.engine.checkpointer.groups = self.torchft[1]
        step = (self.engine.restore() if self.cfg.checkpoint.resume else None) or 0
        if self.torchft is not None:
            if 0 < step < self.cfg.train.steps:
                raise UserError(
                    f"{self.cfg.run.dir} holds a checkpoint of step {step}: torchft's groups do not resume from one "
                    "yet; relaunch with checkpoint.resume=false (the group heals from a live one at its first meeting)"
                )
            # after the restore: torchft keeps the parameters it starts from as the last meeting's
            self.engine.use_groups(TorchftGroups(self.model, self.engine, self.cfg, self.env, *self.torchft))
        self.processes.groups = self.engine.groups
        return step

    def run_config(self) -> dict:
        return {"framework": "torchpar", "backend": self.backend, "world_size": self.env.world}

    def start(self) -> str:
        """Start reading ahead.

        The line also says the parameter elements each rank holds (a collective; a range where ranks differ).
        """
        self.copy_stream = torch.cuda.Stream(self.env.device) if self.env.device.type == "cuda" else None
        self.prefetch = Prefetch(self._read_ahead)
        held, local, state = "", self.engine.local_params, self.engine.optimizer_bytes
        if local is not None:
            counts, state = self._per_rank(local), self._per_rank(state)
            held = f", {min(counts):,}" + (f"-{max(counts):,}" if min(counts) != max(counts) else "") + " per rank"
        state = f"; {optimizer_phrase(self.cfg.optim.name, state, 'rank')}" if state is not None else ""
        groups = self.engine.groups
        return (
            f"backend {self.backend} on {self.env.world} {self.env.device.type} processes; "
            f"{params_phrase(self.cfg.model, self.n_params)}{held}{state}; "
            f"torch.compile {'on' if self.compiled else 'off'}" + (f"\n{groups.describe()}" if groups else "")
        )

    def synchronised(self):
        """Readers of the parameters run inside: DiLoCo's synchronised parameters in the model (torchpar/diloco.py)."""
        groups = self.engine.groups if self.engine else None
        return groups.synchronised() if groups else nullcontext()

    def _per_rank(self, mine: int) -> list[int]:
        """Each rank's value of `mine` (a collective)."""
        env = self.env
        return [int(c) for c in dist.all_sum([mine if r == env.rank else 0 for r in range(env.world)], env)]

    def write_weights(self, path: str, which: str) -> None:
        with self.synchronised():
            full = self.engine.full_state_dict() if self.engine else self.model.state_dict()  # a collective if sharded
        if self.is_main:
            save_weights(path, unflatten(to_shared(full, self.cfg.model.n_layer)), vars(self.cfg.model))
            print(f"wrote {which} weights to {path}", file=sys.stderr)

    def close(self) -> None:
        """Stop reading ahead.

        No save is in flight (DCP and DeepSpeed save synchronously); the groups go in dist.teardown.
        """
        if self.prefetch is not None:
            self.prefetch.close()

    # the loop
    def _host_rows(self, data: GlobalBatches, step: int) -> torch.Tensor:
        """This rank's rows of the global batch at `step` (pipeline: every stage of a replica reads its share)."""
        share, ways, n = self.engine.data_rank, self.engine.data_ways, data.batch_size(step)
        if self.torchft is not None and data is self.train_data:  # this group's block (each group evaluates it all)
            group, groups = self.torchft
            share, ways = group * ways + share, ways * groups
        return torch.from_numpy(data.rows(step, share * n // ways, (share + 1) * n // ways)).long()

    def _rows(self, data: GlobalBatches, step: int) -> torch.Tensor:
        return self._host_rows(data, step).to(self.env.device)

    def _read_ahead(self, step: int):
        """On the prefetch thread.

        The rows, and on a GPU their copy from pinned memory on a side stream (the copy overlaps the running
        step; the event marks its end).
        """
        rows = self._host_rows(self.train_data, step)
        if self.copy_stream is None:
            return rows, None
        with torch.cuda.stream(self.copy_stream):
            rows = rows.pin_memory().to(self.env.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return rows, done

    def train_step(self, step: int):
        rows, done = self.prefetch(step)
        if done is not None:  # the step's stream waits for the copy; the memory is not reused before it ends
            torch.cuda.current_stream().wait_event(done)
            rows.record_stream(torch.cuda.current_stream())
        return self.engine.update(rows, self._share(rows))

    def _share(self, rows: torch.Tensor) -> float:
        """jaxpar's token_share (jaxpar/loss.py) of the global batch.

        Target positions per counted target over every rank's rows (a collective; ranks that read the same rows
        count them alike, which the ratio cancels). 1.0, and no collective, for data without a loss mask.
        """
        if not self.train_data.masked:
            return 1.0
        targets = rows[:, 1:]
        n, counted = dist.all_sum([targets.numel(), int((targets >= 0).sum())], self.env)
        return n / max(counted, 1.0)

    def fetch(self, handle) -> dict:
        return self.engine.read(handle)

    # the hooks' work
    def evaluate(self, batches: int) -> float:
        engine = self.engine
        engine.module.eval()
        losses = []
        with self.synchronised():
            for i in range(batches):
                rows = self._rows(self.val_data, i)
                losses.append(engine.eval_loss(rows, self._share(rows)))
        engine.module.train()
        return dist.all_sum([sum(losses) / len(losses)], self.env)[0] / engine.data_ways

    def sample(self, step: int) -> list[int] | None:
        """Rank 0 decodes with its whole copy of the model (none and ddp: checks.validate refuses the others)."""
        if not self.env.is_main:
            return None
        prompt_len, new = sample_lengths(self.cfg.model.max_seq_len)
        prompt = unmasked(self._rows(self.val_data, 0)[:1, :prompt_len])
        model = self.engine.raw.eval()
        with self.synchronised():
            out = generate(model, prompt, new, seed=step, temperature=0.8, top_k=40)
        model.train()
        return prompt[0].tolist() + out[0].tolist()

    def task_model(self, batch_size: int):
        """Each rank scores with its whole copy of the model (none and ddp: the contract refuses the others)."""
        from torchpar.scoring import TorchLM, TorchScorer  # deferred: lm-eval (~1 s), only with train.eval_tasks

        return TorchLM(TorchScorer(self.engine.raw), self.cfg.data.tokenizer, batch_size, self.env)

    def save(self, step: int) -> None:
        self.engine.save(step, {"step": step, "data_step": step, "backend": self.backend, "world_size": self.env.world})


class TorchProcesses:
    """The process group's work (jaxpar/core/run/adapter.py's `Processes`): torch.distributed, the launcher's store."""

    def __init__(self, env):
        self.env, self.synced_s = env, 0.0
        self.groups = None  # DiLoCo's (the engine's): torchft's heal a group that comes back

    def rejoined_at(self) -> int | None:
        """The data step to continue from where this group healed from a live one in the last step (torchft), once."""
        step = getattr(self.groups, "healed_to", None)
        if step is not None:
            self.groups.healed_to = None
        return step

    def any_of(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank; the time spent here counts as `sync_wait_s`."""
        t0 = time.perf_counter()  # the loop agrees once per step: the time spent here is waiting for the others
        try:
            return dist.any_rank(flag, self.env)  # one tiny all-reduce
        finally:
            self.synced_s += time.perf_counter() - t0

    def sync_wait_s(self) -> float:
        return self.synced_s

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (a row each, by rank), on every rank."""
        rows = [None] * self.env.world
        torch.distributed.all_gather_object(rows, [float(v) for v in values])
        return rows

    def roll_call(self, wait_s: float) -> list[int]:
        return dist.roll_call(self.env, wait_s)


class TorchProbes:
    """A TorchTrainer's measurements (`Probes`): peak FLOP/s, the data wait, CUDA memory and utilisation."""

    def __init__(self, trainer: TorchTrainer):
        self.trainer = trainer

    def peak_flops(self) -> float | None:
        device = self.trainer.env.device
        peak = peak_flops(
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", self.trainer.cfg.model.compute_dtype
        )
        return peak * self.trainer.env.world if peak else None

    def record_extra(self) -> dict:
        return {}

    def data_wait_s(self) -> float:
        return self.trainer.prefetch.waited_s

    def memory(self) -> dict:
        device = self.trainer.env.device
        if device.type != "cuda":
            return {"memory_in_use_gib": None, "memory_gib": None}
        return {
            "memory_in_use_gib": torch.cuda.memory_allocated(device) / 2**30,
            "memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        }

    def device_utilization(self) -> float | None:
        """The GPU's busy percentage over the last sample period (NVML, where pynvml is installed)."""
        device = self.trainer.env.device
        try:
            return float(torch.cuda.utilization(device)) if device.type == "cuda" else None
        except Exception:  # no pynvml, or NVML unavailable: not worth failing a run over
            return None


class TorchProfiling:
    """torch.profiler for a TorchTrainer (`Profiling`): train.profile_steps's trace, the sampled step's collectives."""

    def __init__(self, cfg: Config, backend: str, env):
        self.cfg, self.backend, self.env, self.profiler, self.comm = cfg, backend, env, None, None

    def start(self) -> None:
        """train.profile_steps=a:b -> <run.dir>/profile/trace_rank<r>.json."""
        self.profiler = torch.profiler.profile()
        self.profiler.start()

    def stop(self) -> None:
        self.profiler.stop()
        os.makedirs(os.path.join(self.cfg.run.dir, "profile"), exist_ok=True)
        self.profiler.export_chrome_trace(os.path.join(self.cfg.run.dir, "profile", f"trace_rank{self.env.rank}.json"))
        self.profiler = None

    def comm_axes(self) -> list[str]:
        return list(axis_sizes(self.cfg, self.backend, self.env.world))

    def comm_start(self) -> None:
        self.comm = CommTrace(self.env.device)

    def comm_stop(self, step: int | None) -> dict[str, float]:
        """Seconds the sampled step's collectives were in flight per axis (None: just stop)."""
        comm, self.comm = self.comm, None
        return comm.stop(None if step is None else axis_sizes(self.cfg, self.backend, self.env.world))


class TorchFaults:
    """The test faults on a TorchTrainer's engine (`Faults`: TORCHPAR_FAULT_*, jaxpar/core/run/faults.py)."""

    prefix = "TORCHPAR"

    def __init__(self, trainer: TorchTrainer):
        self.trainer = trainer

    def poison(self) -> None:
        with torch.no_grad():
            for p in self.trainer.engine.module.parameters():
                p.mul_(float("nan"))

    def overflow(self) -> None:
        self.trainer.engine.inject_overflow()

    def settle(self) -> None:
        """DCP saves here are synchronous: nothing in flight."""
