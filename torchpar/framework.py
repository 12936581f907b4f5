"""What the shared loop (jaxpar/core/loop.py) drives on the torch side: the backend's engine (its whole step),
this rank's rows of each batch read ahead, evaluation, sampling, saves, and the collectives the loop needs."""
from __future__ import annotations

import os

import torch

from jaxpar.core.config import Config
from jaxpar.core.data_order import GlobalBatches, unmasked
from jaxpar.core.loop import sample_lengths
from jaxpar.core.prefetch import Prefetch
from torchpar import dist
from torchpar.backends import Engine


class TorchFramework:
    """What the shared loop (jaxpar/core/loop.py) needs from torch: the engine's step, data, DCP saves."""
    fault_prefix = "TORCHPAR"

    def __init__(self, cfg: Config, data, backend: str, engine: Engine, env):
        self.cfg, self.engine, self.env, self.backend = cfg, engine, env, backend
        self.train_data, self.val_data = data  # read straight from the memmap, in the shared order
        self.profiler = None
        self.copy_stream = torch.cuda.Stream(env.device) if env.device.type == "cuda" else None
        self.prefetch = Prefetch(self._read_ahead)

    def close(self) -> None:
        self.prefetch.close()

    def _host_rows(self, data: GlobalBatches, step: int) -> torch.Tensor:
        """This rank's rows of the global batch at `step` (pipeline: every stage of a replica reads its share)."""
        share, ways, n = self.engine.data_rank, self.engine.data_ways, data.batch_size(step)
        return torch.from_numpy(data.rows(step, share * n // ways, (share + 1) * n // ways)).long()

    def _rows(self, data: GlobalBatches, step: int) -> torch.Tensor:
        return self._host_rows(data, step).to(self.env.device)

    def _read_ahead(self, step: int):
        """On the prefetch thread: the rows, and on a GPU their copy from pinned memory on a side stream (the
        copy overlaps the running step; the event marks its end)."""
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
        return self.engine.train_step(rows, self._share(rows))

    def _share(self, rows: torch.Tensor) -> float:
        """jaxpar's token_share (jaxpar/loss.py) of the global batch: target positions per counted target over
        every rank's rows (a collective; ranks that read the same rows count them alike, which the ratio
        cancels). 1.0, and no collective, for data without a loss mask."""
        if not self.train_data.masked:
            return 1.0
        targets = rows[:, 1:]
        n, counted = dist.all_sum([targets.numel(), int((targets >= 0).sum())], self.env)
        return n / max(counted, 1.0)

    def data_wait_s(self) -> float:
        return self.prefetch.waited_s

    @property
    def process_count(self) -> int:
        return self.env.world

    def roll_call(self, wait_s: float) -> list[int]:
        return dist.roll_call(self.env, wait_s)

    def agree_stop(self, requested: bool) -> bool:
        return dist.any_rank(requested, self.env)  # one tiny all-reduce per step

    def sample(self, step: int) -> list[int] | None:
        """Rank 0 decodes with its whole copy of the model (none and ddp: check() refuses the others)."""
        if not self.env.is_main:
            return None
        from torchpar.decode import generate

        prompt_len, new = sample_lengths(self.cfg.model.max_seq_len)
        prompt = unmasked(self._rows(self.val_data, 0)[:1, :prompt_len])
        model = self.engine.raw.eval()
        out = generate(model, prompt, new, seed=step, temperature=0.8, top_k=40)
        model.train()
        return prompt[0].tolist() + out[0].tolist()

    def fetch(self, handle) -> dict:
        return self.engine.read(handle)

    def evaluate(self, batches: int) -> float:
        engine = self.engine
        engine.module.eval()
        losses = []
        for i in range(batches):
            rows = self._rows(self.val_data, i)
            losses.append(engine.eval_loss(rows, self._share(rows)))
        engine.module.train()
        return dist.all_sum([sum(losses) / len(losses)], self.env)[0] / engine.data_ways

    def save(self, step: int) -> None:
        self.engine.save(step, {"step": step, "data_step": step, "backend": self.backend,
                                "world_size": self.env.world})

    def settle(self) -> None:
        """DCP saves here are synchronous: nothing in flight."""

    def memory(self) -> dict:
        if self.env.device.type != "cuda":
            return {"memory_in_use_gib": None, "memory_gib": None}
        return {"memory_in_use_gib": torch.cuda.memory_allocated(self.env.device) / 2**30,
                "memory_gib": torch.cuda.max_memory_allocated(self.env.device) / 2**30}

    def profile_start(self) -> None:  # train.profile_steps=a:b -> <run.dir>/profile/trace_rank<r>.json
        self.profiler = torch.profiler.profile()
        self.profiler.start()

    def profile_stop(self) -> None:
        self.profiler.stop()
        os.makedirs(os.path.join(self.cfg.run.dir, "profile"), exist_ok=True)
        self.profiler.export_chrome_trace(os.path.join(self.cfg.run.dir, "profile", f"trace_rank{self.env.rank}.json"))
        self.profiler = None

    def poison(self) -> None:
        with torch.no_grad():
            for p in self.engine.module.parameters():
                p.mul_(float("nan"))

    def inject_overflow(self) -> None:
        self.engine.inject_overflow()
