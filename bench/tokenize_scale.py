"""Tokenize at scale: tokens/s and peak RSS of `preinfer tokenize` at growing corpus sizes.

    .venv/bin/python -m bench.tokenize_scale [--sizes 1M,50M] [--seq-len 128] [--long-doc 10M]

Goal (#16 item 16): at 50M tokens, tokens/s >= 0.8x and peak RSS <= 1.2x the 1M figures. The
corpus: jsonl files of Zipf-drawn synthetic words; one byte-level BPE (vocab 4096) trained once,
so every size does the same work. Each size runs `run_tokenize` in a fresh process (in_child,
PeakMemory after the imports). --long-doc N: the seconds `pack` takes for one N-token document.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.arms import PeakMemory, in_child
from bench.harness import headline_table, quiet

VOCAB_WORDS, SHARD_ROWS = 20_000, 4096


def _count(text: str) -> int:
    n = float(text.rstrip("MmKk"))
    return int(n * {"m": 1e6, "k": 1e3}.get(text[-1].lower(), 1))


def _words() -> np.ndarray:
    rng = np.random.default_rng(1234)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    return np.array(["".join(rng.choice(letters, k)) for k in rng.integers(2, 10, VOCAB_WORDS)])


def _doc(rng, words: np.ndarray, n_words: int) -> str:
    return " ".join(words[np.minimum(rng.zipf(1.2, n_words), VOCAB_WORDS) - 1])


def write_corpus(root: Path, tokens: int, doc_tokens: int, file_tokens: int, per_word: float):
    """jsonl files under root holding about `tokens` tokens; returns counts."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = _words()
    done = files = docs = 0
    while done < tokens:
        budget, lines = min(file_tokens, tokens - done), []
        while budget > 0:
            n = max(1, int(doc_tokens * rng.uniform(0.2, 1.8)))
            lines.append(json.dumps({"text": _doc(rng, words, max(1, int(n / per_word)))}))
            budget -= n
            done += n
        (root / f"part-{files:05d}.jsonl").write_text("\n".join(lines) + "\n")
        files += 1
        docs += len(lines)
    return {"files": files, "docs": docs}


def train_tokenizer(path: Path) -> float:
    """A BPE trained on a ~200k-token sample, saved to `path`; returns tokens per word."""
    from preinfer.data.tokenization import train_bpe

    rng = np.random.default_rng(99)
    words = _words()
    sample = [_doc(rng, words, 500) for _ in range(300)]
    tok = train_bpe(sample, 4096)
    tok.save(str(path))
    enc = tok.encode_batch(sample, add_special_tokens=False)
    return sum(len(e.ids) for e in enc) / (300 * 500)


def child(spec: dict, _ask=None) -> dict:
    """One size's run_tokenize in this (fresh) process: tokens, seconds, peak RSS."""
    from pipelines.tokenize import run_tokenize
    from preinfer.run.config import load_config

    cfg = load_config("configs/demo.yaml", [
        f"run.dir={spec['run_dir']}", f"data.source={spec['corpus']}",
        f"data.tokenizer={spec['tokenizer']}", "data.max_documents=null",
        f"data.seq_len={spec['seq_len']}", f"data.shard_rows={SHARD_ROWS}",
        "model.vocab_size=4096",
    ])  # fmt: skip
    mem = PeakMemory()
    t0 = time.perf_counter()
    store = run_tokenize(cfg, log=quiet)
    return {"tokens": store.manifest["tokens_in_documents"], "seconds": time.perf_counter() - t0,
            "peak_rss_mb": mem.stop(), "base_rss_mb": mem.baseline,
            "samples": sum(store.manifest["counts"].values())}  # fmt: skip


def long_doc_pack(n: int, seq_len: int) -> float:
    from preinfer.data.packing import pack

    ids = np.random.default_rng(0).integers(1, 4096, n).tolist()
    t0 = time.perf_counter()
    rows = sum(1 for _ in pack([ids], 0, seq_len))
    assert rows == (n + 1) // (seq_len + 1)
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,50M", help="corpus sizes in tokens, comma separated")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--long-doc", default="0", help="also time pack() on one document this long")
    ap.add_argument("--work", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--tiny", action="store_true", help="20k and 40k tokens (tests)")
    a = ap.parse_args(argv)
    # mean tokens per document, tokens per jsonl file
    sizes, doc_tokens, file_tokens = ("20k,40k", 500, "20k") if a.tiny else (a.sizes, 2000, "1M")
    work = Path(a.work or tempfile.mkdtemp(prefix="tokenize_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = work / "tokenizer.json"
    per_word = train_tokenizer(tok)
    results = []
    for size in sizes.split(","):
        corpus = work / f"corpus-{size}"
        info = write_corpus(corpus, _count(size), doc_tokens, _count(file_tokens), per_word)
        r = in_child("bench.tokenize_scale:child", {
            "corpus": str(corpus), "tokenizer": str(tok), "run_dir": str(work / f"run-{size}"),
            "seq_len": a.seq_len})  # fmt: skip
        results.append({"size": size, **info, **r, "tok_s": r["tokens"] / r["seconds"]})
    rows = [("corpus", "tokens", "docs", "files", "seconds", "tokens/s", "peak RSS MiB",
             "RSS growth MiB", "tokens/s vs first", "peak RSS vs first")]  # fmt: skip
    rows += [(r["size"], f"{r['tokens']:,}", f"{r['docs']:,}", r["files"], f"{r['seconds']:.1f}",
              f"{r['tok_s']:,.0f}", f"{r['peak_rss_mb']:.0f}",
              f"{r['peak_rss_mb'] - r['base_rss_mb']:.0f}", f"{r['tok_s'] / results[0]['tok_s']:.2f}",
              f"{r['peak_rss_mb'] / results[0]['peak_rss_mb']:.2f}") for r in results]  # fmt: skip
    print(f"tokenize scale (S={a.seq_len}, shard_rows={SHARD_ROWS}, ~{doc_tokens} tokens/doc, "
          f"{file_tokens} tokens/file)\n\n{headline_table(rows)}\n\ntarget at 50M: tokens/s "
          ">= 0.80x and peak RSS <= 1.20x the 1M figures")  # fmt: skip
    if _count(a.long_doc):
        n = _count(a.long_doc)
        print(f"\npack() of one {n:,}-token document: {long_doc_pack(n, a.seq_len):.2f} s")
    return {"sizes": results}


if __name__ == "__main__":
    main()
