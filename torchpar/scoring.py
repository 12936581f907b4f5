"""The torchpar model as lm-eval's evaluator reads it: per-token log-probabilities and greedy decoding.

`TorchScorer` is the Scorer of jaxpar/core/evaluation/harness.py over a whole model on this process's device (torchpar
evaluates with whole-model ranks: one process, or torchrun's ranks each scoring their share of the requests). Rows are
padded on the right to the longest of the batch; a causal model's scores of a row do not depend on what follows it.
Decoding is torchpar/decode.py's KV cache. `TorchLM` is the lm-eval model over it, with torchrun's ranks as lm-eval's.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist

from jaxpar.core.evaluation.harness import ProjectLM
from torchpar.decode import generate
from torchpar.models.decoder import Decoder


class TorchScorer:
    """Log-probabilities and decoding of `model` (in eval mode while it scores)."""

    def __init__(self, model: Decoder):
        self.model, self.max_length = model, model.cfg.max_seq_len
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def log_probs(self, rows: list[list[int]]) -> list[tuple[list[float], list[bool]]]:
        batch = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.long, device=self.device)
        for i, row in enumerate(rows):
            batch[i, : len(row)] = torch.tensor(row)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        training, _ = self.model.training, self.model.eval()
        logits = self.model(inputs).float()
        self.model.train(training)
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0].cpu()
        greedy = (logits.argmax(-1) == targets).cpu()
        return [(logp[i, : len(r) - 1].tolist(), greedy[i, : len(r) - 1].tolist()) for i, r in enumerate(rows)]

    def generate(
        self, prompts: list[list[int]], new_tokens: int, temperature: float, top_k: int, top_p: float
    ) -> list[list[int]]:
        """Prompts of any lengths, decoded in groups of one length (the decoder reads a [B, P] prompt)."""
        training, _ = self.model.training, self.model.eval()
        out: list = [None] * len(prompts)
        for length in sorted({len(p) for p in prompts}):
            rows = [i for i, p in enumerate(prompts) if len(p) == length]
            batch = torch.tensor([prompts[i] for i in rows], device=self.device)
            for i, tokens in zip(rows, generate(self.model, batch, new_tokens, 0, temperature, top_k, top_p).tolist()):
                out[i] = tokens
        self.model.train(training)
        return out


class TorchLM(ProjectLM):
    """ProjectLM with lm-eval's view of torchrun's ranks: each scores its share, rank 0 gathers."""

    def __init__(self, scorer: TorchScorer, tokenizer: str, batch_size: int, env):
        super().__init__(scorer, tokenizer, batch_size)
        self.env = env

    @property
    def device(self) -> torch.device:
        return self.scorer.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = [torch.zeros_like(tensor) for _ in range(self.env.world)]
        torch_dist.all_gather(out, tensor)
        return torch.stack(out)

    def gather_object(self, obj, dst: int = 0):
        out = [None] * self.env.world if self.env.rank == dst else None
        torch_dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        torch_dist.barrier()
