"""torchpar: jaxpar's GPT, configs and data order on PyTorch (DDP, FSDP2, DeepSpeed ZeRO)."""
