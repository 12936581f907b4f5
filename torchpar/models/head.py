"""The output head's logits and their cross-entropy, whole or in sequence chunks (model.loss_chunks).

jaxpar's models/head.py in torch.

Whole: the logits [batch, seq, vocab] in float32, then `cross_entropy`. In chunks: `chunked_cross_entropy` takes
the final norm's output and the output table and runs the head and the loss one chunk of positions at a time (chunk
c holds positions c, c + n, ... of every row, as jaxpar's), so no more than one chunk's float32 logits ever exist.
An autograd Function: each chunk's gradients are taken in its forward, where the chunk's logits are at hand
(`chunk_loss`: the logits' gradient as softmax minus the target, the head's two products as F.linear's backward makes
them), and kept at the size of the head's input and table; the backward only scales them, so nothing
is recomputed and no checkpointing is involved. The table's gradient sums the chunks' in float32. It runs inside
the model's forward, where DDP, FSDP2 and DeepSpeed ZeRO-3 have the table's full weights at hand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def logits(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float32 logits of the normalized hidden states against the output table.

    The hidden states [batch, seq, embed] against the output table [vocab, embed] in x's dtype -> float32 logits
    [batch, seq, vocab].
    """
    return F.linear(x, table.to(x.dtype)).float()


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy at each position [batch, seq], 0 where the target is skipped (negative)."""
    ce = F.cross_entropy(logits.flatten(0, -2), targets.reshape(-1).clamp(min=0), reduction="none")
    return torch.where(targets >= 0, ce.view(targets.shape), 0.0)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over all target positions of the cross-entropy, a skipped (negative) target counting 0.

    Times the batch's token share, this is the mean over the counted targets.
    """
    return token_losses(logits, targets).mean()


def _split(a: torch.Tensor, n: int) -> torch.Tensor:
    """[batch, seq, ...] -> [batch, seq / n, n, ...] (a view of a contiguous tensor).

    Chunk c, [:, :, c], holds positions c, c + n, ...
    """
    return a.reshape(a.shape[0], a.shape[1] // n, n, *a.shape[2:])


def chunk_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's summed cross-entropy and the gradients of that sum for the head's input and table.

    h [batch, positions, embed] in the compute dtype, w the table in it, t [batch, positions]. The logits' gradient
    is softmax minus the target's one-hot, 0 at a skipped (negative) target: autograd's through log_softmax, written
    out so that the chunk is one function of its inputs (train.compile compiles it, torchpar/parallelize.py: its
    softmax, mask and cast fused, the logits read twice instead of written and read in float32 five times). Cast
    back to the compute dtype as autograd does; the table's gradient in float32.
    """
    z = logits(h, w)
    keep, target = (t >= 0).unsqueeze(-1), t.clamp(min=0).unsqueeze(-1)
    lse = torch.logsumexp(z, -1, keepdim=True)
    loss = torch.where(keep, lse - z.gather(-1, target), 0.0).sum()
    dz = z.sub_(lse).exp_().scatter_add_(-1, target, torch.full_like(lse, -1.0))  # in place: one float32 chunk
    dz = dz.masked_fill_(~keep, 0.0).to(h.dtype)
    return loss, dz @ w, (dz.flatten(0, 1).T @ h.flatten(0, 1)).float()


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, table, targets, n: int, step):
        xs, ts, w = _split(x, n), _split(targets, n), table.detach().to(x.dtype)
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if grads else None
        dtable = torch.zeros(table.shape, dtype=torch.float32, device=x.device) if grads else None
        for c in range(n):
            h, t = xs[:, :, c], ts[:, :, c]
            if not grads:
                total += token_losses(logits(h, w), t).sum()
                continue
            loss, dh, dw = step(h, w, t)
            total += loss
            _split(dx, n)[:, :, c] = dh  # the head's transpose
            dtable += dw
        ctx.save_for_backward(dx, dtable)
        ctx.table_dtype = table.dtype
        return total / targets.numel()

    @staticmethod
    def backward(ctx, g):
        dx, dtable = ctx.saved_tensors
        scale = g / (dx.shape[0] * dx.shape[1])
        return (dx.float() * scale).to(dx.dtype), (dtable * scale).to(ctx.table_dtype), None, None, None


def chunked_cross_entropy(
    x: torch.Tensor, table: torch.Tensor, targets: torch.Tensor, chunks: int, step=chunk_loss
) -> torch.Tensor:
    """cross_entropy(logits(x, table), targets), the logits made one chunk of positions at a time.

    There are `chunks` chunks; the sequence length must be a multiple of `chunks`. `step`: chunk_loss, or its
    compiled twin (train.compile).
    """
    return _Chunked.apply(x, table, targets, chunks, step)
