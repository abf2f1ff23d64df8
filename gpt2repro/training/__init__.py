"""The training step and what it is built from: the trainer's config, the optimizers, FSDP, the memory plan, and the faults a run is tested against."""
