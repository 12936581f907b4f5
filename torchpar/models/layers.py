"""Basic torch layers holding jaxpar's parameter shapes.

Einsum-applied weights of any rank, the norms, rotary embedding (jaxpar/models/layers.py's math), and sketched linear
layers (jaxpar/core/model/layer_rules.py, whose `sketch_matrix` builds the very same sketch here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.model.layer_rules import sketch_dim, sketch_matrix
from torchpar.ops import float8_einsum, float8_matmul


def project(x: torch.Tensor, w: torch.Tensor, equation: str, float8: bool) -> torch.Tensor:
    """A projection's einsum, in float8 under model.float8 (torchpar/ops.py; jaxpar/ops.py `project`)."""
    return float8_einsum(equation, x, w) if float8 else torch.einsum(equation, x, w)


class Dense(nn.Module):
    """weight/bias of arbitrary rank applied by an einsum equation (jaxpar's `kernel`/`bias`).

    `float8`: set by the Decoder under model.float8.
    """

    float8 = False

    def __init__(self, w_shape: tuple[int, ...], b_shape: tuple[int, ...]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(w_shape))
        self.bias = nn.Parameter(torch.zeros(b_shape))

    def forward(self, x: torch.Tensor, equation: str) -> torch.Tensor:
        return project(x, self.weight.to(x.dtype), equation, self.float8) + self.bias.to(x.dtype)


class Kernel(nn.Module):
    """A bias-free weight of any rank applied by an einsum equation (jaxpar's `kernel`)."""

    float8 = False

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))

    def forward(self, x, equation: str):
        return project(x, self.weight.to(x.dtype), equation, self.float8)


class LayerNorm(nn.Module):
    """Statistics in float32 whatever the compute dtype; weight/bias are jaxpar's scale/bias."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d)), eps

    def forward(self, x):
        y = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope(x, theta: float, positions=None, scaled=None):
    """x [batch, seq, ..., r]: pairs (i, i + r/2) rotated by pos * theta^(-2i/r).

    Positions [seq] default 0..T-1, or per row [batch, seq] (packed documents). `scaled`: (frequencies, cos/sin
    factor) of jaxpar/core/model/rotary.py's YaRN instead.
    """
    r, T = x.shape[-1], x.shape[1]
    pos = torch.arange(T, device=x.device) if positions is None else positions
    if scaled is None:
        freqs = theta ** (-torch.arange(r // 2, dtype=torch.float32, device=x.device) * 2 / r)
    else:
        freqs = torch.tensor(scaled[0], dtype=torch.float32, device=x.device)
    angle = pos.to(torch.float32)[..., None] * freqs  # [(batch,) seq, r/2]
    angle = angle.reshape(*angle.shape[:-1], *(1,) * (x.ndim - 3), r // 2)
    factor = 1.0 if scaled is None else scaled[1]
    cos, sin = (factor * angle.cos()).to(x.dtype), (factor * angle.sin()).to(x.dtype)
    x1, x2 = x[..., : r // 2], x[..., r // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class SketchedLinear(nn.Module):
    """A linear layer through a fixed sketch: y = (x S) W + b.

    S is a non-persistent buffer (derived, not trained, not saved), W = `factor` (x S times W in float8 under
    model.float8, as jaxpar's).
    """

    float8 = False

    def __init__(self, cfg: ModelConfig, layer: int, name: str, n_in: int, n_out: int):
        super().__init__()
        self.register_buffer("sketch", torch.from_numpy(sketch_matrix(cfg, layer, name)), persistent=False)
        self.factor = nn.Parameter(torch.empty(sketch_dim(cfg, n_in), n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x, equation: str = ""):
        x, w = x @ self.sketch.to(x.dtype), self.factor.to(x.dtype)
        return (
            float8_matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], -1) if self.float8 else x @ w
        ) + self.bias.to(x.dtype)
