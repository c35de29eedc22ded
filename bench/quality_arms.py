"""The quality study's arms and run configs (bench/quality.py is the entry point).

The study constants (tuned learning rates LR, the lr-sweep grid, TARGET_CLOSE), the two model
configs, `Scale` (the sizes of one study: DEFAULT or QUICK), `Arm` (one training run: model,
mode, seed, M, optimizer, lr, rounds), the --set overrides and Config of a run (`overrides`,
`make_cfg`, `arm_cfg`) and the list of arms a study trains (`plan_arms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# Learning rates, tuned once per optimizer with `--lr-sweep` (see docs/quality.md, "lr tuning"):
# AdamW on full-parameter training (the baseline gets its best lr; BCD reuses it), SGD
# (momentum 0.9) on BCD from the cache, the only place SGD is used.
LR = {"adamw": 2e-3, "sgd": 0.3}
SWEEP_LRS = {"adamw": (3e-4, 6e-4, 1e-3, 2e-3, 3e-3, 6e-3), "sgd": (0.1, 0.3, 1.0)}
TARGET_CLOSE = 1.05  # "within 5%" of full's final val ppl

GPT2 = ("configs/demo.yaml", [])
LLAMA = (
    "configs/llama-small.yaml",
    ["model.max_positions=256", "model.tie_embeddings=false"],
)


@dataclass
class Scale:
    """Sizes of one study (default or --quick)."""

    documents: int
    """Stdlib files in the corpus (builtin source)."""
    steps_per_visit: int
    """S: steps of one block visit at M=3; full trains FULL_ROUNDS * 3 * S steps."""
    full_rounds: int
    bcd_rounds: int
    recompute_rounds: int
    seeds: list[int]
    models: list[str]
    sweep_M: list[int]
    sweep_seeds: list[int]
    sgd_seeds: list[int]
    model_sets: dict[str, list[str]]
    """Model size overrides per model name."""
    val_fraction: float = 0.05
    sweep_rounds: int = 2
    """Rounds of the M-sweep arms (the sweep's multiplier is measurable up to this)."""
    torch_threads: int = 1
    """Intra-op threads of the trainer. 1: on a shared 2-CPU machine two OpenMP threads that
    wait for each other at every op barrier ran 3-4x SLOWER per step than one thread (measured
    under load 6-8); the cache-building Ray actor uses one thread too."""
    eval_every: int = 20
    eval_batches: int = 8
    warmup: int = 10
    batch_size: int = 16
    seq_len: int = 128
    vocab: int = 2048
    probe_steps: int = 3
    M: int = 3


_MODEL_SIZE = {
    "gpt2": ["model.hidden_size=128", "model.num_layers=6", "model.num_heads=4"],
    "llama": [
        "model.hidden_size=128",
        "model.num_layers=6",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=344",
    ],
}
_MODEL_TINY = {
    "gpt2": ["model.hidden_size=64", "model.num_layers=4", "model.num_heads=4"],
    "llama": [
        "model.hidden_size=64",
        "model.num_layers=4",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=172",
    ],
}

DEFAULT = Scale(
    seq_len=64,
    documents=60,
    steps_per_visit=60,
    full_rounds=1,
    bcd_rounds=3,
    recompute_rounds=1,
    seeds=[0, 1, 2],
    models=["gpt2", "llama"],
    sweep_M=[2, 3, 4, 6],
    sweep_seeds=[0],
    sgd_seeds=[0],
    model_sets=_MODEL_SIZE,
)
QUICK = Scale(
    documents=16,
    val_fraction=0.25,
    steps_per_visit=8,
    full_rounds=1,
    bcd_rounds=2,
    recompute_rounds=1,
    seeds=[0],
    models=["gpt2"],
    sweep_M=[2, 3],
    sweep_seeds=[0],
    sgd_seeds=[0],
    model_sets=_MODEL_TINY,
    eval_every=4,
    eval_batches=2,
    warmup=2,
    batch_size=8,
    seq_len=64,
    vocab=512,
    probe_steps=2,
)


@dataclass
class Arm:
    model: str
    mode: str  # full | bcd | bcd-recompute
    seed: int
    M: int
    optimizer: str
    lr: float
    rounds: int
    steps_per_visit: int
    group: str = "main"  # main | sgd | sweep
    stop_rounds: list[int] = field(default_factory=list)
    """Rounds after which the checkpoint is evaluated on the whole val split (excluded from time)."""
    keep_caches: bool = False
    """Keep every cache the arm builds (cache.keep): the memory probes of its blocks read the
    last round's caches, which are current for the arm's final checkpoint."""
    variant: str = ""
    """'global-order': (--diagnose-order only) the trainer reads the cache in a global random
    order instead of the reader's shard-buffered one."""

    @property
    def id(self) -> str:
        base = f"{self.model}-{self.mode}-{self.optimizer}-M{self.M}-s{self.seed}"
        if self.group == "lr":
            base += f"-lr{self.lr:g}"
        return f"{base}-{self.variant}" if self.variant else base

    @property
    def total_steps(self) -> int:
        return self.rounds * self.M * self.steps_per_visit


# ---------------------------------------------------------------------------------------------
# Configs


def overrides(scale: Scale, model: str, run_dir: Path, work: Path, **train) -> list[str]:
    """--set overrides of one run; the data section is identical for both models so they share
    one token store."""
    out = [
        f"run.dir={run_dir}",
        "run.device=cpu",
        "data.source=builtin",
        f"data.max_documents={scale.documents}",
        "data.tokenizer=bpe",
        f"data.vocab_size={scale.vocab}",
        f"data.seq_len={scale.seq_len}",
        f"data.val_fraction={scale.val_fraction}",
        "data.split_seed=0",
        f"data.out_dir={work / 'tokens'}",
        f"model.vocab_size={scale.vocab}",
        "model.dropout=0.0",
        "cache.dtype=bf16",
        "cache.codec=blosc-zstd",
        "cache.shuffle=byte",
        "cache.shard_mb=8",
        "cache.keep=false",
        "preinfer.actors=1",  # 2 CPUs: one actor builds as fast as two, with one process fewer
        "preinfer.micro_batch=32",
        "train.workers=0",
        "train.checkpoint_every=0",
        f"train.eval_every={scale.eval_every}",
        f"train.eval_batches={scale.eval_batches}",
        f"train.warmup_steps={scale.warmup}",
        f"train.batch_size={scale.batch_size}",
        "train.patience=0",
        "train.grad_clip=1.0",
    ]
    out += (GPT2 if model == "gpt2" else LLAMA)[1] + scale.model_sets[model]
    out += [f"{k.replace('__', '.')}={v}" for k, v in train.items()]
    return out


def make_cfg(scale: Scale, model: str, run_dir: Path, work: Path, **train):
    from preinfer.config import load_config

    base = (GPT2 if model == "gpt2" else LLAMA)[0]
    return load_config(ROOT / base, overrides(scale, model, run_dir, work, **train))


def arm_cfg(scale: Scale, arm: Arm, run_dir: Path, work: Path, rounds: int | None = None):
    return make_cfg(
        scale,
        arm.model,
        run_dir,
        work,
        model__init_seed=arm.seed,
        partition__num_blocks=arm.M,
        train__seed=arm.seed,
        train__optimizer=arm.optimizer,
        train__lr=arm.lr,
        train__rounds=rounds or arm.rounds,
        train__max_steps=arm.steps_per_visit,
        train__mode=arm.mode,
        cache__keep=arm.keep_caches,
    )


def plan_arms(scale: Scale) -> list[Arm]:
    S, M = scale.steps_per_visit, scale.M
    arms: list[Arm] = []
    for i, seed in enumerate(scale.seeds):
        for model in scale.models:
            trio = [
                Arm(model, "full", seed, M, "adamw", LR["adamw"], scale.full_rounds, S),
                Arm(
                    model,
                    "bcd",
                    seed,
                    M,
                    "adamw",
                    LR["adamw"],
                    scale.bcd_rounds,
                    S,
                    stop_rounds=sorted({scale.full_rounds, scale.sweep_rounds, scale.bcd_rounds}),
                ),
                Arm(
                    model, "bcd-recompute", seed, M, "adamw", LR["adamw"], scale.recompute_rounds, S
                ),
            ]
            # the order rotates with the seed, so slow drifts of a shared machine's load do not
            # always land on the same arm
            arms += trio[i % 3 :] + trio[: i % 3]
    model0 = scale.models[0]
    for seed in scale.sgd_seeds:
        arms.append(
            Arm(
                model0,
                "bcd",
                seed,
                M,
                "sgd",
                LR["sgd"],
                scale.bcd_rounds,
                S,
                group="sgd",
                stop_rounds=sorted({scale.full_rounds, scale.bcd_rounds}),
            )
        )
        if seed not in scale.seeds:  # its reference full arm
            arms.append(Arm(model0, "full", seed, M, "adamw", LR["adamw"], scale.full_rounds, S))
    for seed in scale.sweep_seeds:
        for m in scale.sweep_M:
            a = Arm(
                model0,
                "bcd",
                seed,
                m,
                "adamw",
                LR["adamw"],
                scale.sweep_rounds,
                max(1, M * S // m),
                group="sweep",
                stop_rounds=sorted({scale.full_rounds, scale.sweep_rounds}),
            )
            if not any(b.id == a.id for b in arms):
                arms.append(a)
        if seed not in scale.seeds and not any(
            b.id == f"{model0}-full-adamw-M{M}-s{seed}" for b in arms
        ):
            arms.append(Arm(model0, "full", seed, M, "adamw", LR["adamw"], scale.full_rounds, S))
    first = first_seeds(scale)
    for a in arms:
        a.keep_caches = a.mode == "bcd" and a.seed == first.get(a.group)
    return arms


def first_seeds(scale: Scale) -> dict[str, int]:
    """The seed whose arms the memory probes re-run, per group."""
    groups = (("main", scale.seeds), ("sgd", scale.sgd_seeds), ("sweep", scale.sweep_seeds))
    return {g: seeds[0] for g, seeds in groups if seeds}
