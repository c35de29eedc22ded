"""data.*: what `preinfer tokenize` reads and how it makes the token store (DataConfig), and the
prompt_template's columns."""

from __future__ import annotations

import functools
import string
from dataclasses import dataclass
from typing import Literal

from core.config import ConfigError
from preinfer.model.modeling import MAX_VOCAB


@dataclass(kw_only=True)
class DataConfig:
    source: str = "builtin"
    """'builtin' (the interpreter's stdlib .py files), local file/dir paths (text/jsonl/parquet), or 'hf:<name>[:<config>]'."""
    objective: Literal["causal", "mlm"] | None = None
    """causal: predict the next token; mlm: masked LM, static masks chosen at tokenize time; null = by model.arch (bert: mlm, others: causal)."""
    format: Literal["text", "prompt_response", "chat"] = "text"
    """text: documents, every token a target; prompt_response: jsonl/parquet/HF rows of a prompt and a response, loss on the response only; chat: rows of a messages column ({role, content} turns) rendered with the tokenizer's chat template, loss on the assistant turns only."""
    text_field: str = "text"
    """Column holding the text in jsonl/parquet/HF sources (format text)."""
    prompt_field: str = "prompt"
    """Column holding the prompt (format prompt_response, when prompt_template is null)."""
    prompt_template: str | None = None
    """Prompt built from columns, e.g. '{instruction}\\n{input}\\n### Response:\\n' (null = the prompt_field column as is; a null value reads as '')."""
    response_field: str = "response"
    """Column holding the response (format prompt_response); a row whose response is missing, null, not a string or empty is a bad row."""
    pairs_as_chat: bool = False
    """prompt_response: render each pair through the tokenizer's chat template as a user turn (the prompt) and an assistant turn (the response); false = prompt + response + the tokenizer's eos."""
    messages_field: str = "messages"
    """Column holding a conversation (format chat): a list of {"role": system|user|assistant|tool, "content": str} turns."""
    split_pairs: bool = False
    """prompt_response / chat: cut the stream of pairs (conversations) every S+1 tokens like text (one may span rows); false = whole ones per row, padded, one longer than S+1 tokens dropped."""
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
    mask_fraction: float = 0.15
    """mlm: fraction of a row's maskable (non-special) positions made targets: 80% [MASK], 10% a random token, 10% kept."""
    mask_seed: int = 0
    """mlm: seed of the static masks (in the token store's fingerprint)."""
    on_bad_rows: Literal["error", "skip"] = "error"
    """Rows lacking a field, or with a null, non-string or (pairs) empty one: error = refuse when over 1% of rows are bad (fewer are skipped); skip = skip them all. Counted in the log and the manifest either way."""

    def __post_init__(self):
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.vocab_size < 260:
            raise ConfigError(
                f"data.vocab_size must be >= 260 (256 bytes + special tokens), got {self.vocab_size}"
            )
        if self.vocab_size > MAX_VOCAB:  # the BPE trainer reserves ~70 bytes an entry up front
            raise ConfigError(
                f"data.vocab_size must be <= {MAX_VOCAB:,} (4x the largest vocabularies in use), "
                f"got {self.vocab_size:,}; 4,096 to 65,536 suits most corpora"
            )
        if self.max_documents is not None and self.max_documents < 2:
            raise ConfigError(f"data.max_documents must be >= 2 or null, got {self.max_documents}")
        if self.shard_rows < 1:
            raise ConfigError(f"data.shard_rows must be >= 1, got {self.shard_rows}")
        if self.prompt_template is not None:
            template_fields(self.prompt_template)  # a ConfigError if it is not a valid template
        if self.split_pairs and not (self.pairs or self.chat):
            raise ConfigError(
                "data.split_pairs=true cuts prompt/response pairs, but data.format is text; "
                "set data.format=prompt_response, or drop data.split_pairs"
            )
        if self.pairs_as_chat and not self.pairs:
            raise ConfigError(
                f"data.pairs_as_chat=true renders prompt/response pairs, but data.format is "
                f"{self.format}; set data.format=prompt_response, or drop data.pairs_as_chat"
            )
        if self.renders_chat and self.tokenizer == "bpe":
            raise ConfigError(
                f"{'data.format=chat' if self.chat else 'data.pairs_as_chat=true'} renders "
                "conversations with the tokenizer's chat template, but data.tokenizer is bpe (a "
                "new BPE has none); set data.tokenizer to a chat model's tokenizer directory"
            )
        if not 0.0 < self.mask_fraction < 1.0:
            raise ConfigError(f"data.mask_fraction must be in (0, 1), got {self.mask_fraction}")
        if self.mask_seed < 0:
            raise ConfigError(f"data.mask_seed must be >= 0, got {self.mask_seed}")

    @property
    def pairs(self) -> bool:
        return self.format == "prompt_response"

    @property
    def chat(self) -> bool:
        return self.format == "chat"

    @property
    def renders_chat(self) -> bool:
        """Rows rendered with the tokenizer's chat template (chat, or pairs_as_chat)."""
        return self.chat or self.pairs_as_chat

    @property
    def mlm(self) -> bool:
        return self.objective == "mlm"


@functools.cache
def template_columns(template: str) -> tuple[str, ...]:
    return tuple(template_fields(template))


def template_fields(template: str) -> list[str]:
    """Column names a prompt_template refers to (`{name}`), in order of appearance."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ConfigError(
            f"data.prompt_template is not a valid template ({e}); write columns as {{name}} and "
            "literal braces as {{{{ and }}}}"
        ) from None
    bad = [n for n in names if not n or n.isdigit() or any(c in n for c in ".[]")]
    if bad or not names:
        raise ConfigError(
            f"data.prompt_template must name columns as {{column}} (found {bad or 'none'}); e.g. "
            "'{instruction}\\n{input}\\n### Response:\\n'"
        )
    return list(dict.fromkeys(names))
