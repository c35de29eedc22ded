"""Corpus reading, tokenizer training/loading and packing into fixed-length samples."""

from __future__ import annotations

from dataclasses import dataclass

from preinfer.confload import ConfigError


@dataclass(kw_only=True)
class DataConfig:
    source: str = "builtin"
    """'builtin' (the interpreter's stdlib .py files), local file/dir paths (text/jsonl/parquet), or 'hf:<name>[:<config>]'."""
    text_field: str = "text"
    """Column holding the text in jsonl/parquet/HF sources."""
    hf_split: str = "train"
    """Split read from an 'hf:' source."""
    max_documents: int | None = None
    """Use only the first N documents (in source order); null = all."""
    tokenizer: str = "bpe"
    """'bpe' (train a byte-level BPE on the train split) or a local tokenizer.json / HF tokenizer dir."""
    vocab_size: int = 4096
    """Vocabulary size of a trained BPE (ignored for a loaded tokenizer)."""
    seq_len: int = 128
    """S, tokens per training sample (each stored sample holds S+1 tokens)."""
    val_fraction: float = 0.05
    """Fraction of documents held out for validation (chosen by a hash of the document)."""
    split_seed: int = 0
    """Seed of the train/val document split."""
    shard_rows: int = 4096
    """Samples per Parquet shard of the token store."""
    out_dir: str | None = None
    """Token store directory; null = <run.dir>/tokens."""

    def __post_init__(self):
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.vocab_size < 260:
            raise ConfigError(
                f"data.vocab_size must be >= 260 (256 bytes + special tokens), got {self.vocab_size}"
            )
        if self.max_documents is not None and self.max_documents < 2:
            raise ConfigError(f"data.max_documents must be >= 2 or null, got {self.max_documents}")
        if self.shard_rows < 1:
            raise ConfigError(f"data.shard_rows must be >= 1, got {self.shard_rows}")
