"""The model and its blocks, no I/O: the HF adapters, the partition into blocks, shapes, the prefix forward and the loss."""
