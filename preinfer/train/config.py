"""train.*: how a block is trained (optimizer, lr schedule, steps, rows per visit, the rotation's
order and the fine-tune levers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from core.config import ConfigError

# The paper's defaults per optimizer: (lr, momentum, weight decay).
PAPER_DEFAULTS = {"sgd": (0.1, 0.9, 1e-5), "adam": (1e-4, 0.0, 1e-5), "adamw": (1e-4, 0.0, 1e-5)}
# train.suffix_lr null: the suffix adapters' peak lr = min(SUFFIX_LR_MULTIPLE x the block's,
# max(the block's, SUFFIX_LR_CAP)). A fine-tune's 3e-4 gives 3e-3, the measured best there
# (LoRA's best lr in our bench was 10x bcd's; 1e-3 was worse, docs/log/2026-12-02.md); a
# pretraining's 2e-3 gives 3e-3, not 10x = 2e-2, which diverged to the unigram level (issue
# #53: ppl 531 against 45; 1x gave 44.2). On a tiny LLaMA at lr 2e-3 (H4): 10x 5.952 (the
# unigram level, 5.935), 1.5x 5.506, 1x 5.493 whole-val loss.
SUFFIX_LR_MULTIPLE = 10.0
SUFFIX_LR_CAP = 3e-3


@dataclass(kw_only=True)
class TrainConfig:
    mode: Literal["bcd", "full", "bcd-recompute"] = "bcd"
    """bcd: block K from the cache; full: all parameters from tokens; bcd-recompute: prefix rerun every step."""
    rounds: int = 1
    """Passes of the rotation over all M blocks (bcd modes)."""
    order: Literal["ascending", "descending", "random"] = "ascending"
    """Blocks per round (bcd modes; full ignores it): 0..M-1; M-1..0 head first (an untied head is in block M-1; GPT-2's tied head matrix is wte, block 0's); random = a permutation per round seeded by (train.seed, round), as BAdam offers."""
    always_train: list[Literal["head"]] = dataclasses.field(default_factory=lambda: ["head"])
    """Parts that train in every bcd visit besides its block: head = the final norm and an untied LM head (block M-1's; a tied head matrix stays block 0's), their optimizer state kept with block M-1's. They follow every cached prefix: no cache is invalidated. Default [head]: the measured best in pretraining and fine-tuning (docs/quality.md, docs/log/2026-12-02.md); [] = the block alone."""
    freeze: list[Literal["embed"]] = dataclasses.field(default_factory=list)
    """Parts that never train: embed = the token embedding, and with it a tied LM head (the same matrix). Its gradient, optimizer state and the head's weight-gradient matmul are then not computed; the final norm still trains (train.always_train). [] = every part trains in its block's visits."""
    suffix_rank: int = 0
    """bcd modes: rank r of LoRA adapters (W x + alpha/r B A x; B starts at 0) on the layer linears of blocks K+1..M-1 (train.suffix_modules; never the embedding or the LM head), trained in the same backward as block K and merged into those blocks at the visit's commit, as BREAD does; they follow block K, so no cache is invalidated. 0 = off; full ignores it (preinfer/train/suffix.py)."""
    suffix_lr: float | None = None
    """Peak learning rate of the suffix adapters (the block's warmup + cosine shape); null = 10 x the block's peak lr (train.lr, or its optimizer's default), at most 3e-3 unless the block's is higher (then the block's): 3e-3 at a fine-tune's 3e-4 and at a pretraining's 2e-3, where 10x diverged."""
    suffix_alpha: float | None = None
    """LoRA scale numerator: the adapters add alpha / suffix_rank x B A; null = 2 x suffix_rank (scale 2)."""
    suffix_modules: Literal["all", "attn", "mlp"] = "all"
    """Which linears of the suffix blocks' layers get adapters: all; attn = attention's (q/k/v/o; GPT-2 c_attn + c_proj); mlp = the MLP's."""
    prefix_adapters: Literal["none", "last"] = "none"
    """bcd modes: last = the last visit of each round (block K > 0) also puts the train.suffix_rank adapters on blocks 0..K-1, so every layer adapts in it; that visit runs its prefix from tokens (no boundary cache is made for it) and merges them at its commit. none = the prefix stays as it is."""
    optimizer: Literal["sgd", "adam", "adamw"] = "adamw"
    """Optimizer of the active block."""
    lr: float | None = None
    """Peak learning rate; null = the paper's default for the optimizer (sgd 0.1, adam/adamw 1e-4)."""
    momentum: float | None = None
    """SGD momentum; null = 0.9."""
    weight_decay: float | None = None
    """Weight decay; null = 1e-5."""
    betas: list[float] | None = None
    """Adam betas; null = [0.9, 0.999]."""
    warmup_steps: int = 10
    """Linear warmup steps, once at the start of the rotation (train.schedule=visit: at the start of each block visit)."""
    schedule: Literal["visit", "run"] = "run"
    """LR warmup + cosine scope: run = one over the rotation (rounds x M visits x the visit's steps; 1.52x full's steps to its plateau ppl against 2.07x per visit, docs/quality.md); visit = within each block visit; full: its own steps either way."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of the peak lr."""
    rewarm_steps: int = 0
    """bcd modes, train.schedule=run: over the first n steps of every visit but the rotation's first, the schedule's lr is scaled by (step + 1) / n, so a block's fresh (or long idle) Adam state does not take full-size steps at once; the rotation's own warmup is train.warmup_steps. 0 = off."""
    max_steps: int = 100
    """Steps per block visit (bcd) or in total (full): the cap of the visit's budget."""
    visit_steps: Literal["equal", "cost"] | list[float] = "equal"
    """bcd modes: how a round's steps are shared by its visits (rotation.rotation_steps). equal = every visit the budget's steps; cost = inversely to the visit's predicted step cost (a deep block's cached visit is cheaper), so every visit takes about the same time and the round about as long as at equal; a list of one weight per block (block 0 first) = the budget's steps x w / mean(w). A visit reads the same rows either way: a longer one reads them more times."""
    epochs: float | None = 1.0
    """Passes over a visit's rows; rows = min(train x sample_fraction, max_steps x batch / epochs), and only those are cached. null = cache every sampled row, train max_steps."""
    cache_visits: float | None = None
    """Rows a round samples, in visits' worth (a visit reads max_steps x batch / epochs rows): null = the block count M (the measured best: each visit reads rows of its own, where the train split holds them); 1 = every visit of the round reads the same rows (the smallest cache). Visits read successive windows of the round's rows; a boundary caches the windows of the visits it serves (ascending: M-K at boundary K)."""
    batch_size: int = 16
    """Global batch size in sequences (split evenly over workers)."""
    grad_clip: float = 1.0
    """Clip the active block's gradient norm to this (0 = off)."""
    eval_every: int = 25
    """Evaluate val loss every this many steps (0 = only at the end)."""
    eval_batches: int = 8
    """Val batches per evaluation (0 = the whole val split)."""
    patience: int = 0
    """Stop the block visit after this many evaluations without improvement (0 = never early-stop)."""
    min_delta: float = 0.0
    """Smallest val-loss decrease that counts as improvement."""
    workers: int = 1
    """Ray Train workers (DDP, gloo on CPU / NCCL on GPU); 0, or 1 outside a Ray cluster job = train in this process."""
    cpus_per_worker: int | None = None
    """CPUs (and torch threads) per Ray Train CPU worker; null = this node's CPUs / workers."""
    checkpoint_every: int = 50
    """Save a resumable mid-block state every this many steps (0 = off)."""
    keep_optimizer_state: bool = True
    """Keep each block's optimizer state (AdamW moments, step) in the checkpoint for its next visit (lower ppl on 3/3 seeds); false = fresh every visit."""
    seed: int = 0
    """Seed of data order and dropout."""
    shuffle_buffer_mb: float = 64.0
    """Host MB of stored cache rows a rank shuffles together (bcd K > 0); a visit's rows that fit are drawn as from tokens."""
    loss_chunk: int = 256
    """Tokens per chunk of the fused LM head + cross-entropy (only (chunk, V) logits alive); 0 = plain."""

    def __post_init__(self):
        for name in ("rounds", "max_steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "eval_every",
            "eval_batches",
            "patience",
            "workers",
            "checkpoint_every",
            "suffix_rank",
            "rewarm_steps",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.cache_visits is not None and not self.cache_visits >= 1:
            raise ConfigError(
                f"train.cache_visits must be >= 1 visits' worth of rows per round (1 = every "
                f"visit reads the same rows), got {self.cache_visits}"
            )
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(
                f"train.epochs must be > 0 passes over the visit's rows, or null, got {self.epochs}"
            )
        if len(set(self.always_train)) != len(self.always_train):
            raise ConfigError(f"train.always_train lists a part twice: {self.always_train}")
        if len(set(self.freeze)) != len(self.freeze):
            raise ConfigError(f"train.freeze lists a part twice: {self.freeze}")
        if self.prefix_adapters != "none" and not self.suffix_rank:
            raise ConfigError(
                f"train.prefix_adapters={self.prefix_adapters} puts train.suffix_rank adapters on "
                "the blocks before the last visit's, but train.suffix_rank is 0: set "
                "train.suffix_rank > 0 (e.g. 16), or train.prefix_adapters=none"
            )
        if self.rewarm_steps and self.schedule != "run":
            raise ConfigError(
                f"train.rewarm_steps={self.rewarm_steps} ramps the lr of each visit of one "
                "schedule over the rotation, but train.schedule=visit already warms up every "
                "visit (train.warmup_steps): set train.rewarm_steps=0, or train.schedule=run"
            )
        if isinstance(self.visit_steps, list) and not (
            self.visit_steps and all(w > 0 for w in self.visit_steps)
        ):
            raise ConfigError(
                f"train.visit_steps must be equal, cost, or a list of one weight > 0 per block "
                f"(block 0 first, e.g. [1.2, 1.0, 0.8]), got {self.visit_steps}"
            )
        if self.cpus_per_worker is not None and self.cpus_per_worker < 1:
            raise ConfigError(f"train.cpus_per_worker must be >= 1, got {self.cpus_per_worker}")
        for name in ("lr", "suffix_lr", "suffix_alpha"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"train.{name} must be > 0 or null, got {getattr(self, name)}")
        if self.loss_chunk < 0:
            raise ConfigError(
                f"train.loss_chunk must be >= 0 tokens (0 = unfused loss), got {self.loss_chunk}"
            )
        if self.shuffle_buffer_mb <= 0:
            raise ConfigError(f"train.shuffle_buffer_mb must be > 0, got {self.shuffle_buffer_mb}")
        for name in ("grad_clip", "weight_decay", "min_delta"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ConfigError(f"train.momentum must be in [0, 1) or null, got {self.momentum}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.betas is not None and (
            len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas)
        ):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), got {self.betas}")
        if self.workers > 1 and self.batch_size % self.workers:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.workers ({self.workers})"
            )

    @property
    def last_block_from_tokens(self) -> bool:
        """Block M-1's visit, the last of every round, reads tokens and no boundary is made for
        it: train.prefix_adapters=last in ascending order (preinfer.schedule.visit_plan decides
        per visit, for every order)."""
        return self.prefix_adapters == "last" and self.order == "ascending"

    def suffix_peak_lr(self) -> float:
        """The suffix adapters' peak lr: train.suffix_lr, or by the null rule (SUFFIX_LR_CAP)."""
        if self.suffix_lr is not None:
            return self.suffix_lr
        lr = self.resolved_optim()["lr"]
        return min(SUFFIX_LR_MULTIPLE * lr, max(lr, SUFFIX_LR_CAP))

    def resolved_optim(self) -> dict:
        """lr, momentum, weight decay and betas with the paper's defaults filled in."""
        lr, mom, wd = PAPER_DEFAULTS[self.optimizer]
        return {
            "lr": self.lr if self.lr is not None else lr,
            "momentum": self.momentum if self.momentum is not None else mom or 0.9,
            "weight_decay": self.weight_decay if self.weight_decay is not None else wd,
            "betas": tuple(self.betas) if self.betas is not None else (0.9, 0.999),
        }
