"""The corpus in document order (files and rows: preinfer/data/corpus.py), the objective, the
train/val split, and tokenizer training/loading. data.* is preinfer/data/config.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from core.config import ConfigError
from preinfer.data.config import DataConfig
from preinfer.data.corpus import CorpusError, Document, RowStats, iter_local, iter_rows
from preinfer.model.modeling import resolve_package_path
from preinfer.runtime import hostmem

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
    if data.mlm and (data.pairs or data.chat):
        raise ConfigError(
            f"data.format={data.format} trains a causal LM, but data.objective is mlm "
            f"(model.arch={arch}); masked-LM data is documents: set data.format=text"
        )


def check_store_objective(data: DataConfig, store) -> None:
    """A token store made for another objective than data.objective (e.g. next-token rows for a
    bert model) is a ConfigError: its labels would train or score the wrong thing."""
    check_objective(data, store.objective, store.path)


def check_objective(data: DataConfig, objective: str, path) -> None:
    """check_store_objective for a store at `path` whose manifest says `objective`."""
    if objective != data.objective:
        raise ConfigError(
            f"the token store {path} holds {objective} rows, but data.objective is "
            f"{data.objective}; rerun `preinfer tokenize --force` with this config"
        )


# ---------------------------------------------------------------------------------------------
# Corpus (local files and rows: preinfer/data/corpus.py)


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


def _iter_hf(spec: str, cfg: DataConfig, stats: RowStats | None) -> Iterator[Document]:
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
    rows = ((f"hf:{name} row {i}", row) for i, row in enumerate(ds))
    yield from iter_rows(rows, cfg, f"hf:{name}", stats, columns_known=ds.column_names)


def iter_documents(cfg: DataConfig, stats: RowStats | None = None) -> Iterator[Document]:
    """Documents of the configured corpus in a fixed order (truncated to max_documents).
    stats: filled with what became of the rows read (unusable, empty, empty files)."""
    if cfg.source == "builtin":
        if cfg.pairs or cfg.chat:
            what = "prompt/response rows" if cfg.pairs else "conversations"
            raise CorpusError(
                f"data.source=builtin holds documents, not {what}; point "
                "data.source at jsonl/parquet files or an hf: dataset, or set data.format=text"
            )
        it = _iter_builtin()
    elif cfg.source.startswith("hf:"):
        it = _iter_hf(cfg.source[3:], cfg, stats)
    else:
        it = iter_local([s for s in cfg.source.split(",") if s], cfg, stats)
    for n, doc in enumerate(it):
        if cfg.max_documents is not None and n >= cfg.max_documents:
            break
        yield doc


def is_val(doc: Document, cfg: DataConfig) -> bool:
    """Deterministic by content: identical documents always land in the same split."""
    h = hashlib.sha256(f"{cfg.split_seed}|".encode())
    h.update(doc.key())  # not concatenated: a huge document is not copied once more
    digest = h.digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < cfg.val_fraction


# ---------------------------------------------------------------------------------------------
# Tokenizer

SPECIAL_EOS = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


# A text longer than this is handed to the tokenizer in pieces. `tokenizers` holds ~150 bytes
# per character of one text while it pre-tokenizes or encodes it (an 8.5 MB document peaked at
# 2 GB), and its BPE trainer takes 256 texts at a time, so what it holds grows with the
# longest texts; pieces this short keep a huge document's cost at that of many short ones.
PIECE_CHARS = 1 << 13
# the bound for a tokenizer whose ids of a piece may differ from the whole's (exact_pieces):
# only a text that would cost hundreds of MB is cut
LOOSE_PIECE_CHARS = 1 << 20
# what one encode_batch call is given at most: its output objects hold tens of bytes per
# character until their ids are taken
BATCH_CHARS = 1 << 19
# a piece starts at the last whitespace character before a non-space one: the byte-level
# pre-tokenizer (and GPT-2 / Llama-3 style split patterns) always starts a pre-token there and
# ends the one before, so the pieces' ids are the ids of the whole text
_CUT = re.compile(r"[ \t\n](?=\S)")


def pieces(text: str, limit: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at most `limit` characters (itself when it is no longer), each
    cut where a byte-level BPE's pre-tokenizer splits anyway (see _CUT), so that encoding the
    pieces gives the ids of encoding the whole, at a bounded memory. A stretch of `limit` / 2
    characters without whitespace is cut between a letter, a digit and another character
    (also a pre-token boundary but for rare contractions), else at `limit`."""
    out, start, n = [], 0, len(text)
    while n - start > limit:
        lo, hi = start + limit // 2, start + limit
        cut = None
        for m in _CUT.finditer(text, lo, hi):
            cut = m.start()
        if cut is None:
            cut = next((i for i in range(hi, lo, -1) if _kind(text[i - 1]) != _kind(text[i])), hi)
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _kind(c: str) -> int:
    return 0 if c.isalpha() else 1 if c.isdigit() else 2


def exact_pieces(tok) -> bool:
    """Whether encoding `pieces` of a text gives this tokenizer's ids of the whole text: no
    normalizer, and a byte-level or split-pattern pre-tokenizer (a SentencePiece-style one
    adds a marker at each piece's start)."""
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return (
        spec.get("normalizer") is None
        and bool(parts)
        and all(p.get("type") in ("ByteLevel", "Split", "Digits") for p in parts)
    )


def encode_ids(tok, texts: list[str], limit: int = PIECE_CHARS) -> list[np.ndarray]:
    """The ids of each text (no special tokens added), int32: a text longer than `limit`
    encoded in `pieces`, and the pieces given to the tokenizer BATCH_CHARS at a time (so one
    huge text holds no more memory than a batch of short ones)."""
    cut = [pieces(t, limit) for t in texts]
    flat = [p for ps in cut for p in ps]
    ids: list[np.ndarray] = []
    start = 0
    while start < len(flat):
        stop, chars = start, 0
        while stop < len(flat) and (stop == start or chars + len(flat[stop]) <= BATCH_CHARS):
            chars += len(flat[stop])
            stop += 1
        enc = tok.encode_batch(flat[start:stop], add_special_tokens=False)
        ids += [np.asarray(e.ids, dtype=np.int32) for e in enc]
        del enc
        start = stop
    out, i = [], 0
    for ps in cut:
        out.append(ids[i] if len(ps) == 1 else np.concatenate(ids[i : i + len(ps)]))
        i += len(ps)
    return out


# bytes tokenizers' BpeTrainer reserves per vocabulary entry before it reads a text (measured:
# vocab_size 1e9 asked ~70 GB and aborted the process, SIGABRT with no Python error; 1e8 aborts
# under a 6 GiB address-space limit, 3e7 fits)
BPE_BYTES_PER_TOKEN = 72


def train_bpe(texts: Iterable[str], vocab_size: int, *, mlm: bool = False):
    """A byte-level BPE with one special token, <|endoftext|>, as EOS (mlm: also [CLS], which
    opens every row, and [MASK]). A long text is learnt from in `pieces` (the same pre-tokens,
    so the same merges, at a bounded memory). Refused (ConfigError) where what the trainer
    reserves for `vocab_size` exceeds the memory this process may allocate."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    need, free = vocab_size * BPE_BYTES_PER_TOKEN, hostmem.available()
    if need > free:
        raise ConfigError(
            f"data.vocab_size={vocab_size:,}: the BPE trainer reserves about "
            f"{need / 2**30:.1f} GiB for it up front, but only {free / 2**30:.1f} GiB of memory "
            "is available here; lower data.vocab_size (4,096 to 65,536 suits most corpora)"
        )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", *(["[CLS]", "[MASK]"] if mlm else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((p for t in texts for p in pieces(t)), trainer=trainer)
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
    """The end-of-document token that text packs between documents: the first of SPECIAL_EOS
    the vocabulary has."""
    for name in SPECIAL_EOS:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ConfigError(
        f"tokenizer has none of the end-of-document tokens {', '.join(SPECIAL_EOS)}; add one"
    )


def hf_tokenizer_dir(spec: str) -> Path | None:
    """data.tokenizer's directory where it is a Hugging Face one (it holds a
    tokenizer_config.json: special tokens, maybe a chat template); None for 'bpe', a bare
    tokenizer.json, or a directory without one."""
    if spec == "bpe":
        return None
    p = resolve_package_path(spec, "data.tokenizer")
    return p if p.is_dir() and (p / "tokenizer_config.json").is_file() else None


def load_hf_tokenizer(path: Path):
    """transformers' tokenizer of the local directory `path` (nothing downloaded)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many kinds for an unloadable directory
        raise ConfigError(f"data.tokenizer {path}: transformers cannot load it ({e})") from None


def pair_eos(spec: str, tok) -> int:
    """The token ending a pair's response (format prompt_response): the tokenizer's own eos
    where data.tokenizer is a Hugging Face directory that names one (a chat model's
    <|im_end|>, not the <|endoftext|> text packs between documents), else eos_id(tok)."""
    hf_dir = hf_tokenizer_dir(spec)
    name = load_hf_tokenizer(hf_dir).eos_token if hf_dir is not None else None
    i = tok.token_to_id(str(name)) if name is not None else None
    return eos_id(tok) if i is None else i
