"""Packing token ids into fixed-length samples of S+1 ids, in time linear in the tokens.

Text: documents are joined with EOS between them and cut every S+1 ids; the last, shorter
piece is dropped. A row's labels are its ids shifted by one (nothing stored).

Prompt/response pairs: a pair is `prompt ids + response ids + EOS`; the response and its EOS
are targets, the prompt is not (label IGNORE). A conversation (data.format=chat, or a pair
rendered through the chat template) is its rendered ids with the targets preinfer/data/chat.py
marks, packed the same way (`PairPacker.add_masked`; its stats count "conversations"). Pairs are packed whole: a row takes pairs while
they fit and is padded with EOS (IGNORE labels) to S+1 ids, a pair longer than S+1 ids is
dropped (counted in `PairPacker.stats`). With split_pairs, pairs are a stream cut every S+1
ids like text, the masks travelling with the ids; a row left without any target is skipped.
Either way, the last row is padded and kept. The attention is not reset between pairs (as
between packed documents): a pair sees the pairs before it in its row.

    labels[t] = ids[t + 1] if position t + 1 is a target else IGNORE     # (S,) per row

Masked LM (data.objective=mlm, `MlmPacker`): the stream of documents (EOS between them) is cut
every S-1 ids and each piece becomes `[CLS] + piece + EOS` (S+1 ids; without a [CLS] in the
tokenizer, pieces of S ids). The inputs are ids[:S] as for a causal row; the last id is a
filler no input or label reads. Static masks (`mask_rows`): in each row, f * n of its n
non-special input positions (rounded at random to an integer, at least one) are targets,
f = data.mask_fraction; a target's input becomes [MASK] (80%), a random non-special token
(10%) or stays (10%). The stored ids are the masked ones (what the model sees, so what a cache
holds); the labels are NOT shifted:

    labels[t] = the original ids[t] if position t is a target else IGNORE   # (S,) per row

Masks are drawn per row from (data.mask_seed, split, row index), so the same inputs give the
same masks whatever the batching, and every epoch (and every cache) sees the same ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from storage.tokens import IGNORE


class Packer:
    """Text packing, one document at a time: `add(ids)` returns the rows it completed."""

    def __init__(self, eos: int, seq_len: int):
        self.eos = np.array([eos], dtype=np.int32)
        self.n = seq_len + 1
        self.carry = np.zeros(0, dtype=np.int32)  # < S+1 ids not yet in a row

    def add(self, ids) -> np.ndarray:
        """The (k, S+1) int32 rows this document completes (k may be 0)."""
        buf = np.concatenate([self.carry, np.asarray(ids, dtype=np.int32), self.eos])
        k = len(buf) // self.n
        self.carry = buf[k * self.n :].copy()
        return buf[: k * self.n].reshape(k, self.n)


def pack(docs_ids: Iterable[list[int]], eos: int, seq_len: int) -> Iterator[np.ndarray]:
    """Concatenate documents with EOS between them and cut rows of S+1 tokens (tail dropped)."""
    packer = Packer(eos, seq_len)
    for ids in docs_ids:
        yield from packer.add(ids)


def labels_of(ids: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(k, S) int32 labels of rows ids (k, S+1) whose positions `target` (k, S+1) bool count."""
    return np.where(target[:, 1:], ids[:, 1:], IGNORE).astype(np.int32)


_EMPTY_BOOL = np.zeros(0, dtype=bool)


class PairPacker:
    """Prompt/response packing: `add(prompt_ids, response_ids)` (or `add_masked(ids, target)`)
    returns the (ids (k, S+1), labels (k, S)) rows it completed; `finish()` the last one. eos:
    what ends a response, and the padding (never a target). unit: the name the stats count
    pairs by ("pairs", "conversations")."""

    def __init__(self, eos: int, seq_len: int, *, split_pairs: bool = False,
                 unit: str = "pairs"):  # fmt: skip
        self.eos = np.array([eos], dtype=np.int32)
        self.n = seq_len + 1
        self.split_pairs = split_pairs
        self.ids = np.zeros(0, dtype=np.int32)  # the row being filled (< S+1 ids)
        self.target = _EMPTY_BOOL
        self.unit = unit
        # shortest / longest: tokens of a pair (prompt + response + EOS), 0 before the first
        self.stats = {unit: 0, "kept": 0, "dropped_too_long": 0, "rows_without_targets": 0,
                      "pad_tokens": 0, "shortest": 0, "longest": 0}  # fmt: skip

    def _rows(self, ids: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keep = target[:, 1:].any(axis=1)  # a row without targets trains nothing
        self.stats["rows_without_targets"] += int((~keep).sum())
        ids, target = ids[keep], target[keep]
        return ids, labels_of(ids, target)

    def _pad(self) -> tuple[np.ndarray, np.ndarray]:
        """The row being filled, padded with EOS (not a target) to S+1 ids."""
        pad = self.n - len(self.ids)
        self.stats["pad_tokens"] += pad
        ids = np.concatenate([self.ids, np.repeat(self.eos, pad)])[None]
        target = np.concatenate([self.target, np.zeros(pad, dtype=bool)])[None]
        self.ids, self.target = np.zeros(0, dtype=np.int32), _EMPTY_BOOL
        return self._rows(ids, target)

    def _none(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((0, self.n), np.int32), np.zeros((0, self.n - 1), np.int32)

    def add(self, prompt_ids, response_ids) -> tuple[np.ndarray, np.ndarray]:
        p = np.asarray(prompt_ids, dtype=np.int32)
        r = np.asarray(response_ids, dtype=np.int32)
        pair = np.concatenate([p, r, self.eos])
        target = np.concatenate([np.zeros(len(p), bool), np.ones(len(r) + 1, bool)])
        return self.add_masked(pair, target)

    def add_masked(self, pair: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pack one pair (conversation) given whole: ids (n,) int32, target (n,) bool."""
        pair = np.asarray(pair, dtype=np.int32)
        self.stats[self.unit] += 1
        st = self.stats
        st["shortest"] = len(pair) if st[self.unit] == 1 else min(st["shortest"], len(pair))
        st["longest"] = max(st["longest"], len(pair))
        if self.split_pairs:
            self.stats["kept"] += 1
            buf = np.concatenate([self.ids, pair])
            tbuf = np.concatenate([self.target, target])
            k = len(buf) // self.n
            self.ids, self.target = buf[k * self.n :].copy(), tbuf[k * self.n :].copy()
            return self._rows(
                buf[: k * self.n].reshape(k, self.n), tbuf[: k * self.n].reshape(k, self.n)
            )
        if len(pair) > self.n:
            self.stats["dropped_too_long"] += 1
            return self._none()
        self.stats["kept"] += 1
        out = self._pad() if len(self.ids) + len(pair) > self.n else self._none()
        self.ids = np.concatenate([self.ids, pair])
        self.target = np.concatenate([self.target, target])
        return out

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """The last, partly filled row (padded), if any."""
        return self._pad() if len(self.ids) else self._none()


# ---------------------------------------------------------------------------------------------
# Masked LM

MASK_REPLACE = (0.8, 0.1, 0.1)  # a target's input: [MASK], a random token, kept
_SPLIT_KEY = {"train": 0, "val": 1}


def mask_rows(
    ids: np.ndarray, rows: np.ndarray, *, split: str, seed: int, fraction: float, mask_id: int,
    special: np.ndarray, pool: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, dict]:  # fmt: skip
    """Static masks of inputs ids (k, S) int32, rows (k,) their row numbers in the split:
    (masked ids (k, S), labels (k, S) int32, counts). special: ids never masked; pool: the ids
    a random replacement is drawn from (the vocabulary less the special ids)."""
    k, s = ids.shape
    # (k, 3S+1) uniforms, one generator per row: which positions (S), what they become (S),
    # which random token (S), and the rounding of the row's target count (1)
    u = np.stack([np.random.default_rng((seed, _SPLIT_KEY[split], int(r))).random(3 * s + 1)
                  for r in rows]) if k else np.zeros((0, 3 * s + 1))  # fmt: skip
    rounding, u = u[:, -1], u[:, :-1].reshape(k, 3, s)
    maskable = ~np.isin(ids, special)  # (k, S)
    n = maskable.sum(1)
    # fraction * n rounded up with probability its fractional part: fraction in expectation
    want = np.where(n > 0, np.maximum(1, np.floor(fraction * n + rounding)), 0).astype(np.int64)
    order = np.argsort(np.where(maskable, u[:, 0], 2.0), axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(s)[None].repeat(k, 0), axis=1)
    target = rank < want[:, None]  # (k, S): the first `want` maskable positions by u[:, 0]
    to_mask = target & (u[:, 1] < MASK_REPLACE[0])
    to_rand = target & ~to_mask & (u[:, 1] < MASK_REPLACE[0] + MASK_REPLACE[1])
    rand = pool[np.minimum((u[:, 2] * len(pool)).astype(np.int64), len(pool) - 1)]
    out = np.where(to_mask, mask_id, np.where(to_rand, rand, ids)).astype(np.int32)
    labels = np.where(target, ids, IGNORE).astype(np.int32)
    counts = {"positions": int(n.sum()), "targets": int(target.sum()),
              "mask_token": int(to_mask.sum()), "random": int(to_rand.sum()),
              "kept": int((target & ~to_mask & ~to_rand).sum())}  # fmt: skip
    return out, labels, counts


class MlmPacker:
    """Masked-LM packing of one split: `add(ids)` returns the (ids (k, S+1), labels (k, S))
    rows a document completed, masked (see the module docstring)."""

    def __init__(
        self, eos: int, seq_len: int, *, cls: int | None, mask_id: int, special, vocab: int,
        split: str, seed: int, fraction: float,
    ):  # fmt: skip
        self.prefix = np.array([] if cls is None else [cls], dtype=np.int32)
        self.eos = eos
        self.packer = Packer(eos, seq_len - len(self.prefix) - 1)  # pieces of S - |prefix| ids
        special = np.unique(np.asarray(special, dtype=np.int64))
        self.kw = dict(split=split, seed=seed, fraction=fraction, mask_id=mask_id, special=special,
                       pool=np.setdiff1d(np.arange(vocab), special))  # fmt: skip
        self.next_row = 0
        self.stats = {"rows": 0, "rows_without_targets": 0, "positions": 0, "targets": 0,
                      "mask_token": 0, "random": 0, "kept": 0}  # fmt: skip

    def add(self, ids) -> tuple[np.ndarray, np.ndarray]:
        pieces = self.packer.add(ids)  # (k, S - |prefix|)
        k = len(pieces)
        rows = np.concatenate(
            [np.repeat(self.prefix[None], k, 0), pieces, np.full((k, 1), self.eos, np.int32)], 1
        )  # (k, S+1)
        numbers = np.arange(self.next_row, self.next_row + k)
        self.next_row += k
        rows[:, :-1], labels, counts = mask_rows(rows[:, :-1], numbers, **self.kw)
        keep = (labels != IGNORE).any(1)  # a row of special tokens only trains nothing
        for key, v in counts.items():
            self.stats[key] += v
        self.stats["rows"] += int(keep.sum())
        self.stats["rows_without_targets"] += int((~keep).sum())
        return rows[keep], labels[keep]
