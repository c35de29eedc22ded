"""Corpus reading, tokenizer training/loading and packing into fixed-length samples."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import string
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.config import ConfigError
from preinfer.modeling import resolve_package_path


@dataclass(kw_only=True)
class DataConfig:
    source: str = "builtin"
    """'builtin' (the interpreter's stdlib .py files), local file/dir paths (text/jsonl/parquet), or 'hf:<name>[:<config>]'."""
    objective: Literal["causal", "mlm"] | None = None
    """causal: predict the next token; mlm: masked LM, static masks chosen at tokenize time; null = by model.arch (bert: mlm, others: causal)."""
    format: Literal["text", "prompt_response"] = "text"
    """text: documents, every token a target; prompt_response: jsonl/parquet/HF rows of a prompt and a response, loss on the response only."""
    text_field: str = "text"
    """Column holding the text in jsonl/parquet/HF sources (format text)."""
    prompt_field: str = "prompt"
    """Column holding the prompt (format prompt_response, when prompt_template is null)."""
    prompt_template: str | None = None
    """Prompt built from columns, e.g. '{instruction}\\n{input}\\n### Response:\\n' (null = the prompt_field column as is; a null value reads as '')."""
    response_field: str = "response"
    """Column holding the response (format prompt_response)."""
    split_pairs: bool = False
    """prompt_response: cut the stream of pairs every S+1 tokens like text (a pair may span rows); false = whole pairs per row, padded, a pair longer than S+1 tokens dropped."""
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
        if self.prompt_template is not None:
            template_fields(self.prompt_template)  # a ConfigError if it is not a valid template
        if not 0.0 < self.mask_fraction < 1.0:
            raise ConfigError(f"data.mask_fraction must be in (0, 1), got {self.mask_fraction}")
        if self.mask_seed < 0:
            raise ConfigError(f"data.mask_seed must be >= 0, got {self.mask_seed}")

    @property
    def pairs(self) -> bool:
        return self.format == "prompt_response"

    @property
    def mlm(self) -> bool:
        return self.objective == "mlm"


MLM_ARCHS = ("bert",)  # bidirectional encoders: a position sees its own token


def resolve_objective(data: DataConfig, arch: str) -> None:
    """Set data.objective by model.arch when null (bert: mlm, else causal); an objective the
    architecture cannot train is a ConfigError."""
    by_arch = "mlm" if arch in MLM_ARCHS else "causal"
    if data.objective is None:
        data.objective = by_arch
    elif data.objective != by_arch:
        why = (
            "a bidirectional encoder sees every token, so next-token prediction is trivial"
            if arch in MLM_ARCHS
            else "a causal model sees only the tokens before a position, not a masked one's context"
        )
        raise ConfigError(
            f"data.objective={data.objective} does not fit model.arch={arch} ({why}); use "
            f"data.objective={by_arch} or null (= by model.arch)"
        )
    if data.mlm and data.pairs:
        raise ConfigError(
            f"data.format=prompt_response trains a causal LM, but data.objective is mlm "
            f"(model.arch={arch}); masked-LM data is documents: set data.format=text"
        )


@functools.cache
def _fields(template: str) -> tuple[str, ...]:
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


def check_store_objective(data: DataConfig, store) -> None:
    """A token store made for another objective than data.objective (e.g. next-token rows for a
    bert model) is a ConfigError: its labels would train or score the wrong thing."""
    if store.objective != data.objective:
        raise ConfigError(
            f"the token store {store.path} holds {store.objective} rows, but data.objective is "
            f"{data.objective}; rerun `preinfer tokenize --force` with this config"
        )


# ---------------------------------------------------------------------------------------------
# Corpus


class CorpusError(ConfigError):
    """The corpus cannot be read or is unusable; the message says why and what to do."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    """Stable name of the document (relative path or row index)."""
    text: str
    """The document, or a pair's prompt."""
    response: str | None = None
    """A pair's response (format prompt_response); None for a document."""

    def key(self) -> bytes:
        """The content that identifies it (hashed for the fingerprint and the split)."""
        if self.response is None:
            return self.text.encode()
        return self.text.encode() + b"\0" + self.response.encode()


def builtin_corpus_root() -> Path:
    """The running interpreter's standard library: real text on every machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def _iter_builtin() -> Iterator[Document]:
    root = builtin_corpus_root()
    files = sorted(
        (f for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file()),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            yield Document(f.relative_to(root).as_posix(), text)


_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}


def _local_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for spec in paths:
        p = Path(spec).expanduser()
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _FORMATS)
        elif p.is_file():
            files.append(p)
        else:
            raise CorpusError(
                f"data.source: {spec} does not exist; give a file, a directory or 'builtin'"
            )
    if not files:
        raise CorpusError(f"data.source: no .txt/.jsonl/.parquet files under {', '.join(paths)}")
    bad = [f.name for f in files if f.suffix not in _FORMATS]
    if bad:
        raise CorpusError(
            f"data.source: unsupported file type(s) {', '.join(bad)}; use {', '.join(sorted(_FORMATS))}"
        )
    return files


def _columns(cfg: DataConfig, text_field: str) -> dict[str, str]:
    """{column: the config key naming it} of the columns a row must have."""
    if not cfg.pairs:
        return {text_field: "data.text_field"}
    if cfg.prompt_template is None:
        cols = {cfg.prompt_field: "data.prompt_field"}
    else:
        cols = dict.fromkeys(template_fields(cfg.prompt_template), "data.prompt_template")
    return {**cols, cfg.response_field: "data.response_field"}


def _missing(need: dict[str, str], have, label: str) -> CorpusError | None:
    for col, key in need.items():
        if col not in have:
            return CorpusError(
                f"{key}: column {col!r} not in {label} (columns: {', '.join(sorted(have))})"
            )
    return None


def _doc(row: dict, i: int, cfg: DataConfig, field: str, label: str) -> Document | None:
    """The document (or pair) of one row; None for a row without usable text. A column a row
    lacks reads as null. field: the text column (format text)."""
    if not cfg.pairs:
        text = row.get(field)
        return Document(f"{label}#{i}", text) if isinstance(text, str) and text.strip() else None
    response = row.get(cfg.response_field)
    if cfg.prompt_template is None:
        prompt = row.get(cfg.prompt_field)
    else:
        values = {c: "" if row.get(c) is None else row[c] for c in _fields(cfg.prompt_template)}
        prompt = cfg.prompt_template.format(**values)
    if isinstance(prompt, str) and isinstance(response, str) and (prompt + response).strip():
        return Document(f"{label}#{i}", prompt, response)
    return None


def _iter_rows(
    rows: Iterable[dict], cfg: DataConfig, label: str, *, columns=None, text_field=None
) -> Iterator[Document]:
    """Documents of `rows` (dicts). columns: the column names when known up front (checked
    first); else a column no row holds is an error at the end (nothing of it was yielded)."""
    text_field = text_field or cfg.text_field
    need = _columns(cfg, text_field)
    if columns is not None and (err := _missing(need, set(columns), label)):
        raise err
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise CorpusError(f"data.source: row {i} of {label} is not an object: {row!r:.80}")
        if columns is None:
            seen.update(row)
        doc = _doc(row, i, cfg, text_field, label)
        if doc is not None:
            yield doc
    if columns is None and (err := _missing(need, seen, label)):
        raise err


def _json_rows(f: Path) -> Iterator[dict]:
    """Rows of JSON lines, one at a time (or of one JSON array, read whole)."""
    with open(f, encoding="utf-8") as fh:
        head = fh.read(64).lstrip()
        fh.seek(0)
        if head.startswith("["):
            yield from json.load(fh)
            return
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError as e:
                    raise CorpusError(f"data.source: {f} line {n} is not JSON: {e}") from None


def _parquet_rows(f: Path, columns: list[str]) -> Iterator[dict]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    for batch in pf.iter_batches(batch_size=1024, columns=columns):
        yield from batch.to_pylist()


def _iter_local(paths: list[str], cfg: DataConfig) -> Iterator[Document]:
    """Local files, streamed (a text file is one document; jsonl/parquet rows are read a line
    or a batch at a time)."""
    for f in _local_files(paths):
        kind = _FORMATS[f.suffix]
        label = f.name
        try:
            if kind == "text":
                if cfg.pairs:
                    raise CorpusError(
                        f"data.source: {f} is a text file, but data.format=prompt_response "
                        "reads rows with prompt and response columns; give .jsonl/.parquet "
                        "files or an hf: dataset"
                    )
                with open(f, encoding="utf-8") as fh:  # as `datasets`' text loader reads it
                    rows = [{"text": fh.read()}]
                yield from _iter_rows(rows, cfg, label, columns=["text"], text_field="text")
            elif kind == "json":
                yield from _iter_rows(_json_rows(f), cfg, label)
            else:
                import pyarrow.parquet as pq

                names = pq.read_schema(f).names
                need = [c for c in _columns(cfg, cfg.text_field) if c in names]
                yield from _iter_rows(_parquet_rows(f, need), cfg, label, columns=names)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            if isinstance(e, CorpusError):
                raise
            raise CorpusError(f"data.source: cannot read {f} as {kind}: {e}") from None


HF_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def force_hf_offline() -> None:
    """HF datasets / hub reach no network, whatever the environment says: the variables are
    assigned (a 0 there does not turn offline mode off) before `datasets` is imported, and the
    flags of modules already imported, which read them once at import, are set as well."""
    for key in HF_OFFLINE_ENV:
        os.environ[key] = "1"
    import datasets.config
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def _iter_hf(spec: str, cfg: DataConfig) -> Iterator[Document]:
    force_hf_offline()  # before the import: datasets reads the environment once, when imported
    import datasets

    name, _, conf = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, conf or None, split=cfg.hf_split)
    except Exception as e:
        raise CorpusError(
            f"data.source: hf:{spec} did not resolve offline ({type(e).__name__}: {e}); "
            "point data.source at local files or a dataset already in the HF cache"
        ) from None
    yield from _iter_rows(ds, cfg, f"hf:{name}", columns=ds.column_names)


def iter_documents(cfg: DataConfig) -> Iterator[Document]:
    """Documents of the configured corpus in a fixed order (truncated to max_documents)."""
    if cfg.source == "builtin":
        if cfg.pairs:
            raise CorpusError(
                "data.source=builtin holds documents, not prompt/response rows; point "
                "data.source at jsonl/parquet files or an hf: dataset, or set data.format=text"
            )
        it = _iter_builtin()
    elif cfg.source.startswith("hf:"):
        it = _iter_hf(cfg.source[3:], cfg)
    else:
        it = _iter_local([s for s in cfg.source.split(",") if s], cfg)
    for n, doc in enumerate(it):
        if cfg.max_documents is not None and n >= cfg.max_documents:
            break
        yield doc


def is_val(doc: Document, cfg: DataConfig) -> bool:
    """Deterministic by content: identical documents always land in the same split."""
    digest = hashlib.sha256(f"{cfg.split_seed}|".encode() + doc.key()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < cfg.val_fraction


# ---------------------------------------------------------------------------------------------
# Tokenizer

SPECIAL_EOS = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


def train_bpe(texts: Iterable[str], vocab_size: int, *, mlm: bool = False):
    """A byte-level BPE with one special token, <|endoftext|>, as EOS (mlm: also [CLS], which
    opens every row, and [MASK])."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", *(["[CLS]", "[MASK]"] if mlm else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_file(spec: str) -> Path:

    p = resolve_package_path(spec, "data.tokenizer")
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(
            f"data.tokenizer: {spec} is neither 'bpe' nor a tokenizer.json / directory holding one"
        )
    return p


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def eos_id(tok) -> int:
    for name in SPECIAL_EOS:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ConfigError(
        f"tokenizer has none of the end-of-document tokens {', '.join(SPECIAL_EOS)}; add one"
    )
