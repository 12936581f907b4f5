"""Experiment trackers beside metrics.jsonl (which stays the source of truth), process 0 only.

TensorBoard event files in <run.dir>/tensorboard (run.tensorboard=true; the tensorboardX writer, an extra: pip install
'jaxpar[tensorboard]') and Weights & Biases (run.wandb=offline|online, if the wandb package is installed; offline runs
sync later with `wandb sync`). Both get every numeric metric by step.
"""

from __future__ import annotations

import importlib.util
import os

from jaxpar.core.config.schema import Config
from jaxpar.core.errors import UserError


def check_trackers(cfg: Config) -> None:
    """Before any work: a tracker the config asks for must be installed."""
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise UserError("run.tensorboard=true needs the tensorboardX package (pip install 'jaxpar[tensorboard]')")
    if cfg.run.wandb != "off" and importlib.util.find_spec("wandb") is None:
        raise UserError(f"run.wandb={cfg.run.wandb} needs the wandb package (pip install wandb), or run.wandb=off")


class TensorBoard:
    def __init__(self, cfg: Config):
        from tensorboardX import SummaryWriter  # deferred: tensorboardX, optional: run.tensorboard only

        self.writer = SummaryWriter(logdir=os.path.join(cfg.run.dir, "tensorboard"))

    def log(self, step: int, scalars: dict) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, cfg: Config):
        import wandb  # deferred: wandb, optional: run.wandb only

        name = os.path.basename(os.path.abspath(cfg.run.dir))
        self.run = wandb.init(
            project="jaxpar",
            name=name,
            id=name,
            resume="allow",
            dir=cfg.run.dir,
            mode=cfg.run.wandb,
            config=cfg.to_dict(),
        )

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(cfg: Config, is_main: bool) -> list:
    if not is_main:
        return []
    return ([TensorBoard(cfg)] if cfg.run.tensorboard else []) + ([WandB(cfg)] if cfg.run.wandb != "off" else [])
