"""Stage `preinfer tokenize`: corpus -> tokenizer -> packed train/val token store.

Same inputs (corpus bytes, tokenizer, S, split rule, and for prompt/response data the pair
layout and the token ending a response, for chat data (and pairs rendered as chat) the chat
template and its eos, for masked-LM data the mask rule and seed) give the same fingerprint, and
a rerun over a complete store with that fingerprint does nothing (unless a shard fails its
checksum: then the store is written again).

Rows are never lost silently: pass 1 counts every row it cannot use, by reason
(preinfer/data/corpus.py RowStats), and refuses more than 1% of them unless data.on_bad_rows=skip,
before anything is written; the counts go to the log and the manifest's "rows". A failed tokenize leaves nothing
behind (its temp store, and the directories it made), and of two writing one store at once the
second to commit is refused (storage/tokens.py).

A tokenize that writes holds the run.dir lock (preinfer/run/lock.py) as init, bcd and train do,
so it is refused while a live run of that run.dir holds it (with --force before the corpus is
read). A token store outside run.dir may be another run's: replacing one is refused too while
the run that made it (the run.dir in its manifest) is live. (A run that only reads a store made
by another run.dir is not seen: that check names the maker's run.dir only.) Temp stores that a
killed tokenize left beside the store are removed first (storage/tokens.py clean_stale_partials).

Streaming: the corpus is read in passes (hash and count; train the BPE; encode and pack), never
held whole; what stays in memory is one batch of documents, a row being packed and at most a
shard of rows per split (the writer's buffers). A long document reaches the tokenizer in pieces
cut where its pre-tokenizer splits anyway (preinfer/data/tokenization.py `pieces`): the same ids, at
the memory of many short documents.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

import tokenizers
from tqdm import tqdm

from core.config import ConfigError
from core.fingerprint import chain, file_hash
from preinfer.data.chat import ChatTemplate
from preinfer.data.config import DataConfig
from preinfer.data.corpus import CorpusError, RowStats
from preinfer.data.packing import MASK_REPLACE, MlmPacker, Packer, PairPacker
from preinfer.data.tokenization import (
    BATCH_CHARS,
    LOOSE_PIECE_CHARS,
    PIECE_CHARS,
    encode_ids,
    eos_id,
    exact_pieces,
    is_val,
    iter_documents,
    load_tokenizer,
    pair_eos,
    tokenizer_file,
    train_bpe,
)
from preinfer.model.modeling import resolve_checkpoint_path
from preinfer.run.config import Config
from preinfer.run.lock import RunDirLocked, check_writable, describe_holder, live_holder, run_lock
from storage import fs
from storage.atomic import as_os_error
from storage.tokens import (
    TokenStore,
    TokenStoreError,
    TokenStoreWriter,
    clean_stale_partials,
    manifest_bytes,
)

ENCODE_BATCH = 64  # documents per tokenizer call (encode_batch runs them on its threads)


def tokenizer_spec(cfg: Config) -> dict:
    d = cfg.data
    if d.tokenizer == "bpe":
        return {"kind": "bpe", "vocab_size": d.vocab_size, "tokenizers": tokenizers.__version__}
    return {"kind": "file", "sha256": file_hash(tokenizer_file(d.tokenizer))}


def model_record(cfg: Config) -> dict:
    """The manifest's "model": the config's model settings, or where model.checkpoint is set,
    the checkpoint's own shape as its config.json gives it (the config's model defaults do not
    apply to it), with that file's path and sha256. tie_word_embeddings: None where the file
    does not say (the model class's default holds)."""
    model = cfg.to_dict()["model"]
    if cfg.model.checkpoint is None:
        return model
    path = resolve_checkpoint_path(cfg.model.checkpoint) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(
            f"model.checkpoint: {path} is not JSON ({e}); fix or re-save it"
        ) from None

    def first(*keys):  # GPT-2 names some fields its own way (n_embd, n_layer)
        return next((hf[k] for k in keys if k in hf), None)

    return {
        "arch": cfg.model.arch,
        "checkpoint": cfg.model.checkpoint,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
        "hidden_size": first("hidden_size", "n_embd"),
        "num_layers": first("num_hidden_layers", "n_layer"),
        "vocab_size": hf.get("vocab_size"),
        "tie_word_embeddings": hf.get("tie_word_embeddings"),
        "config_json": str(path.absolute()),
        "config_sha256": file_hash(path),
    }


def _scan(d: DataConfig) -> tuple[str, dict[str, int], RowStats]:
    """Pass 1: (corpus hash, documents per split, what became of the rows read)."""
    corpus, counts, rows = hashlib.sha256(), {"train": 0, "val": 0}, RowStats()
    for doc in iter_documents(d, rows):
        corpus.update(hashlib.sha256(doc.key()).digest())
        counts["val" if is_val(doc, d) else "train"] += 1
    return corpus.hexdigest(), counts, rows


def _check_out(cfg: Config, out, *, access: bool) -> None:
    """Refuse a store directory that cannot be made (a file in the way) or, with access, not
    written, in the words of the setting: run.dir where the store is under it (the default)."""
    if fs.is_url(out):
        return
    if Path(cfg.run.dir) in out.parents:
        check_writable(cfg.run.dir, "run.dir", access=access)
    check_writable(out, "data.out_dir", replaced=True, access=access)


def tokens_fingerprint(cfg: Config, corpus: str, rendering: dict | None = None) -> str:
    """rendering: what pairs or chat rows are rendered with beyond the config (the chat
    template's `describe()`, or a pair's eos where it is not eos_id's); None: nothing more."""
    d = cfg.data
    parts = {}
    if d.pairs:  # text stores keep the fingerprints they had before pairs existed
        parts["pairs"] = {
            "prompt": d.prompt_template if d.prompt_template is not None else d.prompt_field,
            "response": d.response_field,
            "split_pairs": d.split_pairs,
            "too_long": "drop",
            "targets": "response + EOS",
            **(rendering or {}),
        }
    if d.chat:
        parts["chat"] = {"messages": d.messages_field, "split_pairs": d.split_pairs,
                         "too_long": "drop", **(rendering or {})}  # fmt: skip
    if d.mlm:  # causal stores keep the fingerprints they had before masked LM existed
        parts["mlm"] = {
            "seed": d.mask_seed,
            "fraction": d.mask_fraction,
            "replace": list(MASK_REPLACE),
            "rule": "per row: fraction * non-special inputs (rounded at random) are targets, "
            "drawn by rng(seed, split, row)",
            "row": "[CLS] + S-1 ids + filler (S ids + filler without [CLS]); labels unshifted",
        }
    return chain(
        "tokens",
        corpus=corpus,
        tokenizer=tokenizer_spec(cfg),
        seq_len=d.seq_len,
        split={
            "rule": "sha256(seed|text) < val_fraction",
            "val_fraction": d.val_fraction,
            "seed": d.split_seed,
        },
        **parts,
    )[:32]


def _pair_end(d: DataConfig, tok, chat: ChatTemplate | None) -> tuple[int | None, dict | None]:
    """(the id that ends a pair's response or pads a chat row, None for text; what the
    fingerprint records of how pairs / conversations are rendered) for a loaded tokenizer."""
    if chat is not None:
        return (chat.eos if chat.eos is not None else eos_id(tok)), chat.describe()
    if not d.pairs:
        return None, None
    own = pair_eos(d.tokenizer, tok)
    try:
        legacy = eos_id(tok)
    except ConfigError:
        legacy = None
    # a store whose pairs end as they did before the tokenizer's own eos was used keeps its
    # fingerprint; one that now ends them otherwise (a chat model's <|im_end|>) gets a new one
    return own, (None if own == legacy else {"eos": tok.id_to_token(own)})


def _train_texts(d: DataConfig):
    for doc in iter_documents(d):
        if not is_val(doc, d):
            yield doc.text
            if doc.response is not None:
                yield doc.response


def _lock(cfg: Config, force: bool, log):
    """The run.dir lock a writing tokenize holds (tidy: a run.dir it made goes again if it
    fails); nothing for a run.dir on an object store."""
    if fs.is_url(cfg.run.dir):
        return contextlib.nullcontext()
    return run_lock(cfg.run.dir, "tokenize --force" if force else "tokenize", log=log, tidy=True)


def _check_not_in_use(cfg: Config, out, found: bytes | None) -> None:
    """Refuse (RunDirLocked) while a live run holds this run.dir, or, when a store is there to
    replace (`found`: its manifest bytes) and it was made for another run.dir, while that run.dir
    is held: replacing it would change that run's data under it. Reads the lock records only."""
    run = cfg.run.dir
    if not fs.is_url(run) and (rec := live_holder(run)):
        raise RunDirLocked(
            f"run.dir {run} is in use by {describe_holder(rec)}; tokenize would change the "
            "token store under it: wait for it to finish (or stop it), or give this run "
            "another run.dir and data.out_dir"
        )
    if found is None or fs.is_url(out):
        return
    try:
        maker = json.loads(found)["config"]["run"]["dir"]
    except (ValueError, KeyError, TypeError):
        return  # a manifest without its config: no run to ask
    if not isinstance(maker, str) or fs.is_url(maker):
        return
    if os.path.realpath(maker) != os.path.realpath(run) and (rec := live_holder(maker)):
        raise RunDirLocked(
            f"data.out_dir {out} is the token store of run.dir {maker}, which is in use by "
            f"{describe_holder(rec)}; replacing the store would change that run's data under "
            "it: wait for it to finish (or stop it), or set data.out_dir elsewhere"
        )


def run_tokenize(cfg: Config, *, force: bool = False, log=print) -> TokenStore:
    d = cfg.data
    t0 = time.perf_counter()
    out = fs.path(d.out_dir)  # a Path, or a RemotePath (s3://...)
    _check_out(cfg, out, access=False)  # a file in the way: said before the corpus is read
    found = manifest_bytes(out)  # the store a commit may replace: another one then is refused
    if force:  # it means to write: a run using this store is named before the corpus is read
        _check_not_in_use(cfg, out, found)
    # a user's tokenizer (and its chat template) first: a missing one is refused before the scan
    tok = load_tokenizer(tokenizer_file(d.tokenizer)) if d.tokenizer != "bpe" else None
    chat = ChatTemplate.load(d.tokenizer, tok) if d.renders_chat else None
    end, rendering = _pair_end(d, tok, chat) if tok is not None else (None, None)
    corpus, docs, rows = _scan(d)
    rows.check(d.on_bad_rows)  # too many unusable rows: refused before anything is written
    for line in rows.lines():
        log(f"tokenize: {line}")
    n_docs = sum(docs.values())
    if not n_docs:
        raise CorpusError(
            f"data.source {d.source!r} holds no non-empty documents; give a corpus with text"
        )
    fingerprint = tokens_fingerprint(cfg, corpus, rendering)
    replace = force
    if TokenStore.exists(out):
        store = TokenStore(out)
        if store.fingerprint == fingerprint:
            bad = store.verify()
            if not bad:
                log(f"tokenize: {out} is current (fingerprint {fingerprint[:12]}); nothing to do")
                return store
            log(f"tokenize: {out} has shards that fail their checksum ({', '.join(bad)}); "
                "writing it again")  # fmt: skip
            replace = True
        elif not force:
            raise TokenStoreError(
                f"{out} holds tokens from other inputs (fingerprint {store.fingerprint[:12]}, "
                f"now {fingerprint[:12]}); pass --force to replace it or set data.out_dir elsewhere"
            )

    _check_out(cfg, out, access=True)  # a current store on a read-only disk is not refused
    for name, n in docs.items():
        if not n:
            raise CorpusError(
                f"the {name} split is empty ({n_docs} documents, val_fraction={d.val_fraction}); "
                "use more documents or change data.val_fraction"
            )

    if tok is None and d.mlm:  # data.tokenizer=bpe, trained on the train split
        tok = train_bpe(_train_texts(d), d.vocab_size, mlm=True)  # with [CLS] and [MASK]
    elif tok is None:
        tok = train_bpe(_train_texts(d), d.vocab_size)
    if d.tokenizer == "bpe":
        _warn_small_vocab(tok, d, log)
    # text (and a BPE's pairs): the end-of-document token; pairs: what ends a response (the
    # tokenizer's own eos); chat: the padding (its eos)
    eos = eos_id(tok) if end is None else end
    mlm = mlm_tokens(tok) if d.mlm else None  # before anything is written: no [MASK] = error
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if cfg.model.checkpoint is None and vocab > cfg.model.vocab_size:
        raise CorpusError(
            f"the tokenizer has {vocab} tokens but model.vocab_size is {cfg.model.vocab_size}; "
            "raise model.vocab_size or lower data.vocab_size"
        )
    model = model_record(cfg)  # before anything is written: a model.checkpoint must be readable

    with _lock(cfg, force, log):  # held while it writes: no run of this run.dir meanwhile
        _check_not_in_use(cfg, out, found)
        for p in clean_stale_partials(out):
            log(f"tokenize: removed {p}, the temp store of a tokenize that is gone (killed)")
        # the directories this tokenize makes (deepest first): removed again if it fails
        made = (
            []
            if fs.is_url(out)
            else [p for p in (out.parent, *out.parent.parents) if not p.exists()]
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        labels = d.pairs or d.chat or d.mlm  # stored: prompt masks, or mlm targets (unshifted)
        writer = None
        try:
            writer = TokenStoreWriter(out, seq_len=d.seq_len, shard_rows=d.shard_rows,
                                      labels=labels, over=found)  # fmt: skip
            tok_tmp = writer.tmp / "tokenizer.json"
            try:
                tok.save(str(tok_tmp))
            except Exception as e:  # tokenizers' I/O errors (a full disk) are not OSErrors
                err = as_os_error(e, out)
                if err is None:
                    raise
                raise err from e
            n_tokens, packers, seen, long = _encode_and_pack(
                cfg, tok, eos, mlm, chat, writer, n_docs, t0
            )
            if seen != corpus:  # read again for this pass: the store must hold what was hashed
                raise CorpusError(
                    f"data.source {d.source!r} changed while it was tokenized (its documents now "
                    "hash differently); nothing was written: rerun when the corpus is settled"
                )
            for name in docs:
                if (d.pairs or d.chat) and writer.rows(name) == 0:
                    _all_too_long(packers[name].stats, name, d)
                if writer.rows(name) == 0:
                    raise CorpusError(
                        f"the {name} split has fewer than S+1 = {d.seq_len + 1} tokens; "
                        "use more documents, a larger data.val_fraction or a smaller data.seq_len"
                        + (
                            " (or a larger data.seq_len: pairs longer than S+1 are dropped)"
                            if d.pairs or d.chat
                            else ""
                        )
                    )
            extra = {}
            if d.pairs or d.chat:
                extra[d.format if d.chat else "pairs"] = {
                    k: dict(p.stats) for k, p in packers.items()
                }
            if d.mlm:
                extra["mlm"] = {k: dict(p.stats) for k, p in packers.items()}
                extra["mlm_tokens"] = {"cls": mlm["cls"], "mask": mlm["mask_id"],
                                       "special": [int(i) for i in mlm["special"]]}  # fmt: skip
            store = writer.commit(
                {
                    "fingerprint": fingerprint,
                    "config": {**cfg.to_dict(), "model": model},
                    "documents": docs,
                    "tokens_in_documents": n_tokens,
                    "vocab_size": vocab,
                    "eos_id": eos,
                    "objective": d.objective,
                    "tokenizer_sha256": file_hash(tok_tmp),
                    "rows": rows.to_dict(),
                    **extra,
                },
                replace=replace,
            )
        except BaseException:
            if writer is not None:
                writer.abort()
            for p in made:  # only those still empty
                with contextlib.suppress(OSError):
                    p.rmdir()
            raise
    dt = time.perf_counter() - t0
    c = store.manifest["counts"]
    what = "pairs" if d.pairs else "conversations" if d.chat else "documents"
    log(
        f"tokenize: {n_docs} {what} ({docs['train']} train / {docs['val']} val), "
        f"objective {d.objective}, "
        f"{n_tokens:,} tokens, vocab {vocab}, S={d.seq_len}: {c['train']} train + {c['val']} val "
        f"samples in {dt:.1f}s ({n_tokens / dt:,.0f} tok/s) -> {out}"
    )
    if long:
        log(
            f"tokenize: {long} texts longer than {LOOSE_PIECE_CHARS:,} characters were encoded "
            "in pieces of at most that size, cut before a space, to bound memory; this "
            "tokenizer (not a byte-level one) may encode the first word of a piece otherwise "
            "than the whole text would"
        )
    if d.pairs or d.chat:
        _log_pairs(store.manifest["pairs" if d.pairs else "chat"], d, log)
    if d.mlm:
        t = store.manifest["mlm"]["train"]
        log(
            f"tokenize: mlm: {t['targets']:,} of {t['positions']:,} maskable train positions "
            f"are targets ({t['mask_token']:,} [MASK], {t['random']:,} random, {t['kept']:,} "
            f"kept; data.mask_fraction={d.mask_fraction}, data.mask_seed={d.mask_seed})"
        )
    return store


# a trained BPE with fewer tokens than this share of data.vocab_size is worth a warning
VOCAB_SHORT = 0.9


def _warn_small_vocab(tok, d: DataConfig, log) -> None:
    """Say so when the BPE learnt far fewer tokens than data.vocab_size asks: its train split
    ran out of pairs to merge (too little text, or the same few words again and again)."""
    got = tok.get_vocab_size(with_added_tokens=True)
    if got >= VOCAB_SHORT * d.vocab_size:
        return
    log(
        f"tokenize: warning: the trained BPE has {got} tokens of data.vocab_size={d.vocab_size}: "
        "the train split holds too little or too repetitive text to learn more merges; give "
        f"more (or more varied) text, or set data.vocab_size={max(got, 260)} (and "
        "model.vocab_size no larger than needed)"
    )


MASK_NAMES = ("[MASK]", "<mask>")
CLS_NAMES = ("[CLS]", "<s>")


def mlm_tokens(tok) -> dict:
    """What masking needs of the tokenizer: cls (or None), mask_id, special (ids never masked
    nor drawn as random replacements: its special added tokens), vocab."""
    mask = next((i for n in MASK_NAMES if (i := tok.token_to_id(n)) is not None), None)
    if mask is None:
        raise CorpusError(
            f"data.objective=mlm needs a mask token, and the tokenizer has none of "
            f"{', '.join(MASK_NAMES)}; use a tokenizer with one (data.tokenizer=bpe adds [MASK])"
        )
    cls = next((i for n in CLS_NAMES if (i := tok.token_to_id(n)) is not None), None)
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    special |= {mask, eos_id(tok)} | ({cls} if cls is not None else set())
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return {"cls": cls, "mask_id": mask, "special": sorted(special), "vocab": vocab}


def _encode_and_pack(
    cfg: Config, tok, eos: int, mlm: dict | None, chat: ChatTemplate | None,
    writer: TokenStoreWriter, n_docs: int, t0,
):  # fmt: skip
    """Pass 3: encode the documents a batch at a time and pack each into its split's rows as
    it comes (train and val interleaved); returns (tokens seen, the packers, the corpus hash of
    what was read). mlm: `mlm_tokens(tok)` for data.objective=mlm, else None; chat: the
    template rows are rendered with (data.format=chat, data.pairs_as_chat), else None."""
    d = cfg.data
    if mlm is not None:
        packers = {
            s: MlmPacker(
                eos, d.seq_len, split=s, seed=d.mask_seed, fraction=d.mask_fraction, **mlm
            )  # fmt: skip
            for s in ("train", "val")
        }
    elif d.pairs or d.chat:
        unit = "pairs" if d.pairs else "conversations"
        packers = {s: PairPacker(eos, d.seq_len, split_pairs=d.split_pairs, unit=unit)
                   for s in ("train", "val")}  # fmt: skip
    else:
        packers = {s: Packer(eos, d.seq_len) for s in ("train", "val")}
    n_tokens, corpus = 0, hashlib.sha256()
    bar = tqdm(total=n_docs, desc="tokenize", unit="doc", disable=None)
    docs = iter_documents(d)
    # a huge document is encoded in pieces; with a tokenizer that may encode a piece's start
    # otherwise than the whole, only one that would cost hundreds of MB, and counted
    exact = exact_pieces(tok)
    limit, long = (PIECE_CHARS if exact else LOOSE_PIECE_CHARS), 0
    while batch := _batch(docs):
        if chat is not None:  # (ids, target) of each rendered conversation
            enc = chat.encode(batch)
        else:
            texts = [doc.text for doc in batch]
            if d.pairs:
                texts += [doc.response for doc in batch]
            long += 0 if exact else sum(len(t) > limit for t in texts)
            enc = encode_ids(tok, texts, limit)
        for j, doc in enumerate(batch):
            corpus.update(hashlib.sha256(doc.key()).digest())
            split = "val" if is_val(doc, d) else "train"
            if chat is not None:
                n_tokens += len(enc[j][0])
                writer.add(split, *packers[split].add_masked(*enc[j]))
            elif d.pairs:
                p, r = enc[j], enc[len(batch) + j]
                n_tokens += len(p) + len(r) + 1
                writer.add(split, *packers[split].add(p, r))
            elif mlm is not None:
                n_tokens += len(enc[j]) + 1
                writer.add(split, *packers[split].add(enc[j]))
            else:
                n_tokens += len(enc[j]) + 1
                writer.add(split, packers[split].add(enc[j]))
        del enc
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):,.0f}")
    bar.close()
    if d.pairs or d.chat:
        for split, p in packers.items():
            writer.add(split, *p.finish())
    return n_tokens, packers, corpus.hexdigest(), long


def _batch(docs) -> list:
    """The next documents to encode at once: ENCODE_BATCH, or fewer holding BATCH_CHARS."""
    out, chars = [], 0
    for doc in docs:
        out.append(doc)
        chars += (
            len(doc.text) + len(doc.response or "") + sum(len(c) for _, c in doc.messages or ())
        )
        if len(out) == ENCODE_BATCH or chars >= BATCH_CHARS:
            break
    return out


def _all_too_long(stats: dict, split: str, d: DataConfig) -> None:
    """Refuse a split whose every pair (conversation) was dropped for its length, saying so."""
    unit = "pairs" if d.pairs else "conversations"
    n, lo, hi = stats[unit], stats["shortest"], stats["longest"]
    what = "prompt + response + EOS" if d.pairs and not d.pairs_as_chat else "as rendered"
    if n and stats["dropped_too_long"] == n:
        keep = f"{hi - 1} keeps every {unit[:-1]}" + (f", {lo - 1} the shortest" if lo < hi else "")
        raise CorpusError(
            f"all {n} {split} {unit} are longer than S+1 = {d.seq_len + 1} tokens ({what}; "
            f"the longest is {hi} tokens, the shortest {lo}), so all were "
            f"dropped and nothing was written; raise data.seq_len ({keep}; model.max_positions "
            "with it), or set data.split_pairs=true"
        )


def _log_pairs(stats: dict, d: DataConfig, log) -> None:
    unit = "pairs" if d.pairs else "conversations"
    what = "prompt + response + EOS" if d.pairs and not d.pairs_as_chat else "as rendered"
    for split, s in stats.items():
        if s["dropped_too_long"]:
            log(
                f"tokenize: {split}: dropped {s['dropped_too_long']} of {s[unit]} {unit} longer "
                f"than S+1 = {d.seq_len + 1} tokens ({what}); raise "
                "data.seq_len to keep them, or set data.split_pairs=true"
            )
        if s["rows_without_targets"]:
            log(f"tokenize: {split}: skipped {s['rows_without_targets']} rows holding no "
                f"{'response' if d.pairs else 'assistant'} token")  # fmt: skip
