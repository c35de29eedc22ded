"""How one block is trained: train.* (the config), the optimizer step, the batches, the suffix adapters."""
