"""The checkpoint: its store and on-disk format, the initial checkpoint, optimizer state, the export to a transformers directory."""
