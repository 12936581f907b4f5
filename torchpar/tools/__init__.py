"""torchpar commands: benchmarks of the real backend step and of torch.distributed collectives."""
