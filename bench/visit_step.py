"""One training step of block 0 from tokens: a preinfer visit's step against BAdam's same step.

    .venv/bin/python -m bench.visit_step                       # SmolLM2 (make real-model), block 0 of 3
    .venv/bin/python -m bench.visit_step --batch 8 --seq 128 --repeats 9 --block 1

Both arms train the same parameters of the same weights on the same batch, fp32, on the same
threads, in one process, interleaved (A B / B A), medians with min..max:
- `preinfer`: the visit's own step (blocks > 0: the frozen prefix first, without grad) (`preinfer.train.step.train_step` over `mode_loss`, the model
  as `Checkpoint.load` builds it, the trainable set `freeze_except` gives, preinfer's AdamW),
  with the config's fused chunked loss (train.loss_chunk);
- `preinfer, unfused loss`: the same with train.loss_chunk=0 (the whole batch's logits);
- `badam`: the HF model as `from_pretrained` builds it, PyPI `badam`'s BlockOptimizer over
  AdamW with preinfer's blocks as its block list (bench.peers_arms.layer_prefixes), HF's own
  loss over the logits (bench.peers_arms.response_loss, the peers bench's), clip and step.
Each arm's step is split into forward + loss, backward, and clip + optimizer step (seconds of
each, medians), which is where a gap shows. The arms' losses on the first step must agree
(same weights, same batch): the table prints them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import (
    ROOT,
    headline_table,
    load_average,
    results_path,
    show,
    spread,
    write_results,
)
from bench.peers_arms import GRAD_CLIP, INSTALL, badam, layer_prefixes, response_loss
from preinfer.checkpoint.init import init_checkpoint
from preinfer.model.adapters import forward_blocks
from preinfer.model.loss import mode_loss
from preinfer.model.partition import freeze_except
from preinfer.run.config import load_config
from preinfer.train.step import build_optimizer

MODEL = ROOT / "models" / "smollm2-135m-instruct"


class PreinferArm:
    """Block `block` of the preinfer checkpoint trained from tokens, as a visit steps it."""

    def __init__(self, cfg, ckpt, block: int, chunk: int):
        self.model, self.adapter = ckpt.load()
        self.part, self.block, self.chunk = ckpt.partition, block, chunk
        self.params = freeze_except(self.model, self.adapter, self.part, block)
        self.model.train()
        self.opt = build_optimizer(self.params, cfg.train)

    def loss(self, x, labels):
        if self.block > 0:  # bcd-recompute: the frozen prefix without grad, as a visit runs it
            with torch.no_grad():
                x = forward_blocks(self.adapter, self.part, x, 0, self.block)
        return mode_loss(self.adapter, self.part, x, labels, mode="bcd-recompute",
                         block=self.block, chunk=self.chunk)  # fmt: skip

    def step(self, x, labels) -> tuple[float, list[float]]:
        return timed_step(self.opt, lambda: self.loss(x, labels), lambda: self.params)


def timed_step(opt, loss_fn, params_fn) -> tuple[float, list[float]]:
    """One optimizer step: its loss, and the seconds of forward + loss, backward, clip + step."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params_fn(), GRAD_CLIP)
    opt.step()
    t3 = time.perf_counter()
    return loss.item(), [t1 - t0, t2 - t1, t3 - t2]


class BadamArm:
    """The HF model with BAdam's BlockOptimizer on preinfer's blocks, block `block` active."""

    def __init__(self, model_dir: Path, blocks: list[tuple[int, int]], block: int, lr: float):
        import transformers as tf

        self.model = tf.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
        )
        self.opt = badam(self.model, lr, layer_prefixes(blocks))
        for _ in range(block):
            self.opt.switch_trainable_params(verbose=0)
        self.model.train()

    def step(self, x, labels) -> tuple[float, list[float]]:
        return timed_step(self.opt, lambda: response_loss(self.model, x, labels), lambda: [
            p for p in self.model.parameters() if p.requires_grad and p.grad is not None])  # fmt: skip


def run(args) -> dict:
    if not (args.model / "config.json").exists():
        raise SystemExit(f"no model at {args.model}; {INSTALL}")
    torch.set_num_threads(args.threads)
    over = ["model.arch=llama", f"model.checkpoint={args.model}", f"data.tokenizer={args.model}",
            f"partition.num_blocks={args.blocks}", f"train.lr={args.lr}", *args.set]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "finetune.yaml", over)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(cfg.model, cfg.partition.num_blocks, Path(tmp) / "checkpoint")
        arms = {
            "preinfer": PreinferArm(cfg, ckpt, args.block, cfg.train.loss_chunk),
            "preinfer, unfused loss": PreinferArm(cfg, ckpt, args.block, 0),
            "badam": BadamArm(args.model, ckpt.partition.blocks, args.block, args.lr),
        }
        V = ckpt.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, V, (args.batch, args.seq + 1), generator=g) for _ in range(4)]
    load0 = load_average()
    first = {k: a.step(batches[0][:, :-1], batches[0][:, 1:])[0] for k, a in arms.items()}
    secs = {k: [] for k in arms}
    parts = {k: [] for k in arms}
    for r in range(args.repeats):
        b = batches[(r + 1) % len(batches)]
        for k in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            _, p = arms[k].step(b[:, :-1], b[:, 1:])
            secs[k].append(sum(p))
            parts[k].append(p)
    ref = secs["badam"]
    return {
        "bench": "visit_step", "model": str(args.model), "block": args.block,
        "blocks": [list(b) for b in ckpt.partition.blocks], "batch": args.batch, "seq": args.seq,
        "threads": args.threads, "repeats": args.repeats, "loss_chunk": cfg.train.loss_chunk,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_before": load0, "load_after": load_average(), "first_step_loss": first,
        "seconds": {k: spread(v) for k, v in secs.items()},
        "parts": {k: [statistics.median(p[i] for p in v) for i in range(3)]
                  for k, v in parts.items()},
        "badam_over_arm": {k: spread([b / a for b, a in zip(ref, v, strict=True)])
                           for k, v in secs.items()},
    }  # fmt: skip


def table(res: dict) -> str:
    rows = [("arm", "first-step loss", "step s, median [min, max]", "BAdam / arm (speed)",
             "forward+loss s", "backward s", "clip+step s")]  # fmt: skip
    rows += [(k, f"{res['first_step_loss'][k]:.4f}", show(s, "{:.3f}"),
              show(res["badam_over_arm"][k], "{:.3f}"), *(f"{p:.3f}" for p in res["parts"][k]))
             for k, s in res["seconds"].items()]  # fmt: skip
    return (f"block {res['block']} of {res['blocks']} from tokens, batch {res['batch']} x "
            f"{res['seq']}, fp32, {res['threads']} threads, {res['repeats']} interleaved repeats; "
            f"load {res['load_before']} -> {res['load_after']}\n\n" + headline_table(rows))  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--set", nargs="+", default=[], help="config overrides")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = run(args)
    print(table(res))
    path = write_results(Path(args.out) if args.out else results_path("visit_step"), res)
    print(f"results: {path.name}")
    return res


if __name__ == "__main__":
    main()
