"""Reuse a cache: train a linear probe on cached activations.

The probe reads the hidden state at each position of a cache (the activations entering one
block, written once by pre-inference) and predicts that position's label, the next token id.
It reports the probe's cross-entropy on a fixed set of cache rows before and after training.
No model is run: the cache is the whole input.

    make demo                                   # writes runs/demo/cache
    .venv/bin/python examples/probe.py --cache-root runs/demo/cache [--fingerprint FP] [--steps N]

Run it as a script from the repository root: it imports only the public surface of `storage`
(installed editable by `make setup`), so it needs no sys.path change and no package install.
Without --fingerprint it takes the complete train cache of the highest boundary under the
root (`preinfer cache ls` lists them).
"""

from __future__ import annotations

import argparse
import math

import torch

from storage import CacheDataset, list_caches, open_cache

IGNORE = -100  # a label that does not count (F.cross_entropy's default ignore_index)


def pick_fingerprint(root: str) -> str:
    """The complete train cache of the highest boundary (newest on a tie) under `root`."""
    rows = [r for r in list_caches(root) if r["complete"]]
    if not rows:
        raise SystemExit(f"no complete cache under {root}: run `make demo` first")
    train = [r for r in rows if r["split"] == "train"] or rows
    best = max(train, key=lambda r: (r["boundary"] or 0, r["created"] or ""))
    return best["fingerprint"]


def num_classes(cache) -> int:
    """The model's vocabulary size from the cache's meta; else the largest label + 1."""
    vocab = ((cache.manifest.get("meta") or {}).get("model") or {}).get("vocab_size")
    if vocab:
        return int(vocab)
    top = max(
        int(cache.read_labels(*cache.shard_range(i))[0].max()) for i in range(cache.num_shards)
    )
    return top + 1


def probe_loss(probe: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor):
    """Mean cross-entropy of the probe over every position: hidden (B, S, H), labels (B, S)."""
    logits = probe(hidden.flatten(0, 1))
    return torch.nn.functional.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-root", required=True, help="a cache root, e.g. runs/demo/cache")
    ap.add_argument(
        "--fingerprint",
        help="the cache to read (default: the complete train cache of the highest boundary)",
    )
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    ap.add_argument("--batch-size", type=int, default=16, help="cache rows a step")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--eval-rows", type=int, default=64, help="rows the loss is measured on")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    fp = args.fingerprint or pick_fingerprint(args.cache_root)
    cache = open_cache(args.cache_root, fp)  # refuses an incomplete or damaged cache
    print(f"cache {fp}: {cache}")
    torch.manual_seed(args.seed)
    probe = torch.nn.Linear(cache.hidden_size, num_classes(cache))
    torch.nn.init.zeros_(probe.weight)  # starts as the uniform prediction: loss log(classes)
    torch.nn.init.zeros_(probe.bias)
    opt = torch.optim.Adam(probe.parameters(), lr=args.lr)

    # a fixed set of rows to measure the loss on (they are also in the training stream)
    eval_hidden, eval_labels, _ = cache.read_rows(0, min(args.eval_rows, cache.num_samples))

    def evaluate() -> float:
        with torch.no_grad():
            return float(probe_loss(probe, eval_hidden, eval_labels))

    before = evaluate()
    uniform = math.log(probe.out_features)
    print(f"probe loss before: {before:.4f} (uniform over {probe.out_features}: {uniform:.4f})")

    # shuffled fp32 batches (hidden (B, S, H), labels (B, S)), one epoch after another
    data = CacheDataset(cache, batch_size=args.batch_size, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=None)  # the dataset batches
    step, epoch = 0, 0
    while step < args.steps:
        data.set_epoch(epoch)
        for hidden, labels in loader:
            loss = probe_loss(probe, hidden, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 50 == 0 or step == args.steps:
                print(f"  step {step}: train loss {loss.item():.4f}")
            if step == args.steps:
                break
        epoch += 1

    after = evaluate()
    print(f"probe loss after {step} steps: {after:.4f} (before: {before:.4f})")
    return {"fingerprint": fp, "steps": step, "before": before, "after": after}


if __name__ == "__main__":
    main()
