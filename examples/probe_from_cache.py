"""Train a linear probe on one layer of a model, from an extracted cache.

The probe reads the hidden state entering layer L at every position (what `preinfer cache
extract --layers L` cached) and predicts the next token, as one of the `--classes` most frequent
next tokens of the cache or "other". It reports its cross-entropy and accuracy on held-out rows
(the val cache of the same layer and model, when extracted; else the train cache's first rows)
before and after training, beside the majority class's accuracy. No model runs here: the cache
is the whole input, read through the torch Dataset (`storage.CacheDataset`).

    # a tiny model, in seconds (configs/demo.yaml)
    make tokenize init extract LAYERS=3 MAX_ROWS=2000
    make extract LAYERS=3 SPLIT=val
    .venv/bin/python examples/probe_from_cache.py --cache-root runs/demo/cache --layer 3

    # SmolLM2-135M-Instruct (`make real-model` writes it; configs/chat.yaml points at it)
    make real-model
    make tokenize init extract CONFIG=configs/chat.yaml LAYERS=6,12
    make extract CONFIG=configs/chat.yaml LAYERS=6,12 SPLIT=val
    .venv/bin/python examples/probe_from_cache.py --cache-root runs/chat/cache --layer 12

Every cache is opened with the identity this script expects (`expect=`: the layer and split,
and with --model the checkpoint's content hash, `cache inspect FP` shows it), so a cache of
another layer, split or model is refused in one line instead of training a wrong probe.
It imports only the public surface of `storage`; copy it and change the head or the target.
"""

from __future__ import annotations

import argparse

import torch

from storage import CacheDataset, list_caches, open_cache

IGNORE = -100  # a label that does not count (F.cross_entropy's default ignore_index)


def find_cache(root: str, layer: int, split: str) -> str | None:
    """The newest complete cache of `layer` and `split` under `root` (None: there is none)."""
    rows = [r for r in list_caches(root) if r["complete"]]
    rows = [r for r in rows if r.get("layer") == layer and r.get("split") == split]
    return max(rows, key=lambda r: r["created"] or "")["fingerprint"] if rows else None


def top_labels(cache, k: int) -> torch.Tensor:
    """(vocab+1,) long: each token id's class, 0..k-1 for the k most frequent next tokens of
    the cache, k for the rest; the last entry maps IGNORE to itself (see to_classes)."""
    counts = torch.zeros(0, dtype=torch.long)
    for i in range(cache.num_shards):
        lab = cache.read_labels(*cache.shard_range(i))[0].flatten()
        lab = lab[lab != IGNORE]
        c = torch.bincount(lab)
        counts = torch.nn.functional.pad(counts, (0, max(0, len(c) - len(counts))))
        counts[: len(c)] += c
    table = torch.full((len(counts),), k, dtype=torch.long)
    table[counts.argsort(descending=True)[:k]] = torch.arange(min(k, len(counts)))
    return table


def to_classes(labels: torch.Tensor, table: torch.Tensor, k: int) -> torch.Tensor:
    """Next-token labels (B, S) -> classes (B, S); IGNORE stays, unseen ids are 'other' (k)."""
    out = torch.full_like(labels, k)
    seen = (labels >= 0) & (labels < len(table))
    out[seen] = table[labels[seen]]
    out[labels == IGNORE] = IGNORE
    return out


class Probe(torch.nn.Module):
    """Standardize each hidden feature (mean/std of the first rows), then one linear layer."""

    def __init__(self, sample: torch.Tensor, classes: int):
        super().__init__()
        flat = sample.flatten(0, 1)  # (rows * S, H)
        self.register_buffer("mean", flat.mean(0))
        self.register_buffer("std", flat.std(0).clamp_min(1e-6))
        self.linear = torch.nn.Linear(flat.shape[1], classes)
        torch.nn.init.zeros_(self.linear.weight)  # starts uniform: loss log(classes)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, S, H) -> (B, S, classes)
        return self.linear((hidden - self.mean) / self.std)


def measure(probe, hidden, classes) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over the positions that count."""
    with torch.no_grad():
        logits = probe(hidden).flatten(0, 1)
        y = classes.flatten()
        keep = y != IGNORE
        loss = torch.nn.functional.cross_entropy(logits[keep], y[keep])
        return float(loss), float((logits[keep].argmax(-1) == y[keep]).float().mean())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-root", required=True, help="a cache root, e.g. runs/demo/cache")
    ap.add_argument("--layer", type=int, required=True, help="the layer L the cache holds")
    ap.add_argument("--fingerprint", help="the train cache (default: the newest of --layer)")
    ap.add_argument("--model", help="the checkpoint's content hash the cache must come from")
    ap.add_argument("--classes", type=int, default=255, help="most frequent next tokens kept")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    ap.add_argument("--batch-size", type=int, default=16, help="cache rows a step")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--eval-rows", type=int, default=64, help="held-out rows measured")
    ap.add_argument("--seed", type=int, default=0, help="shuffle and init seed")
    args = ap.parse_args(argv)

    expect = {"layer": args.layer, "split": "train"}
    if args.model:
        expect["model"] = args.model
    fp = args.fingerprint or find_cache(args.cache_root, args.layer, "train")
    if fp is None:
        raise SystemExit(
            f"no train cache of layer {args.layer} under {args.cache_root}: run "
            f"`make extract LAYERS={args.layer}` (with your CONFIG) first"
        )
    cache = open_cache(args.cache_root, fp, expect=expect)  # refuses another layer / model
    model = cache.identity.get("model")
    print(f"train cache {fp}: {cache}, layer {args.layer}, model {str(model)[:12]}")

    # held out: the val cache of the same layer and model, else the first train rows
    val_fp = find_cache(args.cache_root, args.layer, "val")
    held = cache
    if val_fp is not None:
        held = open_cache(args.cache_root, val_fp, expect={**expect, "split": "val",
                                                             "model": model})  # fmt: skip
    eval_hidden, eval_labels, _ = held.read_rows(0, min(args.eval_rows, held.num_samples))
    where = f"val cache {val_fp}" if val_fp is not None else "train rows (no val cache)"

    k = args.classes
    table = top_labels(cache, k)
    eval_classes = to_classes(eval_labels, table, k)
    torch.manual_seed(args.seed)
    probe = Probe(cache.read_rows(0, min(64, cache.num_samples))[0], k + 1)
    opt = torch.optim.Adam(probe.parameters(), lr=args.lr)
    counted = eval_classes[eval_classes != IGNORE]
    majority = float((counted == counted.mode().values).float().mean())
    before = measure(probe, eval_hidden, eval_classes)
    print(f"held out: {where}; loss before {before[0]:.4f}, majority-class accuracy {majority:.3f}")

    # shuffled fp32 batches (hidden (B, S, H), labels (B, S)), seeded: the order is reproducible
    data = CacheDataset(cache, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                        expect=expect)  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=None)  # the dataset batches
    step, epoch = 0, 0
    while step < args.steps:
        data.set_epoch(epoch)
        for hidden, labels in loader:
            y = to_classes(labels, table, k)
            loss = torch.nn.functional.cross_entropy(
                probe(hidden).flatten(0, 1), y.flatten(), ignore_index=IGNORE
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 100 == 0 or step == args.steps:
                print(f"  step {step}: train loss {loss.item():.4f}")
            if step == args.steps:
                break
        epoch += 1
    after = measure(probe, eval_hidden, eval_classes)
    print(
        f"probe after {step} steps: held-out loss {after[0]:.4f} (before {before[0]:.4f}), "
        f"accuracy {after[1]:.3f} (majority class {majority:.3f})"
    )
    return {"fingerprint": fp, "layer": args.layer, "held_out": val_fp, "steps": step,
            "before": before[0], "after": after[0], "accuracy": after[1],
            "majority": majority}  # fmt: skip


if __name__ == "__main__":
    main()
