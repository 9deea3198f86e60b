"""The executor: apply a plan with real FSDP2 and measure it (the only stage that imports torch.distributed)."""
