"""Text to token rows: the corpus readers, tokenization, packing and the chat template."""
