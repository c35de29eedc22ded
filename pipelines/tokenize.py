"""Stage `preinfer tokenize`: corpus -> tokenizer -> packed train/val token store.

Same inputs (corpus bytes, tokenizer, S, split rule) give the same fingerprint, and a
rerun over a complete store with that fingerprint does nothing.
"""

from __future__ import annotations

import hashlib
import time

import tokenizers
from tqdm import tqdm

from core.fingerprint import chain, file_hash
from preinfer.config import Config
from preinfer.tokenization import (
    CorpusError,
    eos_id,
    is_val,
    iter_documents,
    load_tokenizer,
    pack,
    tokenizer_file,
    train_bpe,
)
from storage import fs
from storage.tokens import TokenStore, TokenStoreError, TokenStoreWriter


def tokenizer_spec(cfg: Config) -> dict:
    d = cfg.data
    if d.tokenizer == "bpe":
        return {"kind": "bpe", "vocab_size": d.vocab_size, "tokenizers": tokenizers.__version__}
    return {"kind": "file", "sha256": file_hash(tokenizer_file(d.tokenizer))}


def run_tokenize(cfg: Config, *, force: bool = False, log=print) -> TokenStore:
    d = cfg.data
    t0 = time.perf_counter()
    docs = list(iter_documents(d))
    if not docs:
        raise CorpusError(
            f"data.source {d.source!r} holds no non-empty documents; give a corpus with text"
        )
    corpus = hashlib.sha256()
    for doc in docs:
        corpus.update(hashlib.sha256(doc.text.encode()).digest())
    fingerprint = chain(
        "tokens",
        corpus=corpus.hexdigest(),
        tokenizer=tokenizer_spec(cfg),
        seq_len=d.seq_len,
        split={
            "rule": "sha256(seed|text) < val_fraction",
            "val_fraction": d.val_fraction,
            "seed": d.split_seed,
        },
    )[:32]
    out = fs.path(d.out_dir)  # a Path, or a RemotePath (s3://...)
    if TokenStore.exists(out):
        store = TokenStore(out)
        if store.fingerprint == fingerprint:
            log(f"tokenize: {out} is current (fingerprint {fingerprint[:12]}); nothing to do")
            return store
        if not force:
            raise TokenStoreError(
                f"{out} holds tokens from other inputs (fingerprint {store.fingerprint[:12]}, "
                f"now {fingerprint[:12]}); pass --force to replace it or set data.out_dir elsewhere"
            )

    splits = {"train": [], "val": []}
    for doc in docs:
        splits["val" if is_val(doc, d) else "train"].append(doc)
    for name, part in splits.items():
        if not part:
            raise CorpusError(
                f"the {name} split is empty ({len(docs)} documents, val_fraction={d.val_fraction}); "
                "use more documents or change data.val_fraction"
            )

    if d.tokenizer == "bpe":
        tok = train_bpe((doc.text for doc in splits["train"]), d.vocab_size)
    else:
        tok = load_tokenizer(tokenizer_file(d.tokenizer))
    eos = eos_id(tok)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if cfg.model.checkpoint is None and vocab > cfg.model.vocab_size:
        raise CorpusError(
            f"the tokenizer has {vocab} tokens but model.vocab_size is {cfg.model.vocab_size}; "
            "raise model.vocab_size or lower data.vocab_size"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = TokenStoreWriter(out, seq_len=d.seq_len, shard_rows=d.shard_rows)
    try:
        tok_tmp = writer.tmp / "tokenizer.json"
        tok.save(str(tok_tmp))
        n_tokens = 0
        bar = tqdm(total=len(docs), desc="tokenize", unit="doc", disable=None)

        def encoded(part):
            nonlocal n_tokens
            for i in range(0, len(part), 64):
                batch = tok.encode_batch(
                    [doc.text for doc in part[i : i + 64]], add_special_tokens=False
                )
                for enc in batch:
                    n_tokens += len(enc.ids) + 1
                    yield enc.ids
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):,.0f}")

        for name, part in splits.items():
            n = writer.write_split(name, pack(encoded(part), eos, d.seq_len))
            if n == 0:
                raise CorpusError(
                    f"the {name} split has fewer than S+1 = {d.seq_len + 1} tokens; "
                    "use more documents, a larger data.val_fraction or a smaller data.seq_len"
                )
        bar.close()
        store = writer.commit(
            {
                "fingerprint": fingerprint,
                "config": cfg.to_dict(),
                "documents": {k: len(v) for k, v in splits.items()},
                "tokens_in_documents": n_tokens,
                "vocab_size": vocab,
                "eos_id": eos,
                "tokenizer_sha256": file_hash(tok_tmp),
            },
            replace=force,
        )
    except BaseException:
        writer.abort()
        raise
    dt = time.perf_counter() - t0
    c = store.manifest["counts"]
    log(
        f"tokenize: {len(docs)} documents ({len(splits['train'])} train / {len(splits['val'])} val), "
        f"{n_tokens:,} tokens, vocab {vocab}, S={d.seq_len}: {c['train']} train + {c['val']} val "
        f"samples in {dt:.1f}s ({n_tokens / dt:,.0f} tok/s) -> {out}"
    )
    return store
