"""optim.fused: torchpar's AdamW as torch's fused kernel, the same updates as its foreach default."""

import numpy as np
import torch

from tests.helpers import tiny_config


def test_the_fused_kernel_steps_as_the_foreach_path():
    from torchpar.models.decoder import Decoder
    from torchpar.optim import make_optimizer

    runs = []
    for fused in (False, True):
        cfg = tiny_config(f"optim.fused={'on' if fused else 'off'}", "optim.weight_decay=0.1")
        model = Decoder(cfg.model)
        model.init_weights(0)
        opt = make_optimizer(model, cfg)
        assert bool(opt.defaults.get("fused")) == fused
        rng = np.random.default_rng(0)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.from_numpy(rng.normal(size=tuple(p.shape)).astype(np.float32))
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_auto_fuses_on_a_gpu_and_keeps_foreach_on_the_cpu():
    """optim.fused=auto: the fused kernel on a GPU, where it measured 1.29x; the foreach path on the CPU."""
    from torchpar.models.decoder import Decoder
    from torchpar.optim import make_optimizer, use_fused

    assert use_fused("auto", "cuda") and not use_fused("auto", "cpu")
    assert use_fused("on", "cpu") and not use_fused("off", "cuda")
    model = Decoder(tiny_config().model)
    assert not make_optimizer(model, tiny_config()).defaults.get("fused")  # auto, on this CPU
    assert make_optimizer(model, tiny_config("optim.fused=on")).defaults.get("fused")
