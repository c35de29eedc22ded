"""`preinfer plan`: will it fit, how big is the cache, what will it cost — before anything runs.

Pure arithmetic over the model's shapes (read off a meta-device build: no weight memory, so
7B/20B configs are fine) and the config. Memory is per card, the peak over the phases of one
visit, each phase a sum of what is alive then:

  trainer   backward  weights of the loaded blocks + optimizer state + saved activations,
                      swept from the loss down as activations turn into gradients (the loss
                      peak holds four logit-sized fp32 tensors: logits, log-softmax, 2 grads)
            step      + all gradients of the active block + the optimizer's temporaries
            eval      + the eval forward (bcd K > 0 on CPU: + the val cache reader)
            load      (CPU) + the checkpoint hash's copy of the largest tensor
  pre-inf.  prefix weights in the cache dtype + one micro-batch's inference working set;
            on CPU also one shard of outputs (list + concatenation) and its encode

Derived (arithmetic): weights, gradients, optimizer state, saved activations — per-layer
element counts of what autograd keeps for the HF layer implementations with a fused SDPA kernel
(no S x S matrix), checked against `saved_tensors_hooks` in tests/test_plan.py. Measured
(CPU only, see the constants below): fixed runtime overhead and the host-side I/O and
allocator factors. Assumed (GPU): the CUDA context reserve; no GPU was available to validate.
Cost: steps x time per step x cards x price, time from metrics.jsonl throughput when the run
has one, else FLOPs / (peak x MFU), labelled as such.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB, MiB = 2**30, 2**20


@dataclass(frozen=True)
class Precision:
    weight: int  # bytes per loaded weight
    grad: int  # bytes per gradient element (active parameters)
    master: int  # fp32 master copy per active parameter (pure bf16 training only)
    act: int  # bytes per saved activation element
    cast: int  # bf16 weight copies autocast saves for backward, per suffix matmul weight
    logit: int  # bytes per logit held at the loss peak (4 copies in fp32, see _sweep)
    keep: int  # bytes per logit the train step keeps alive through backward (logits + grad)


PRECISIONS = {
    "fp32": Precision(4, 4, 0, 4, 0, 16, 8),
    # torch.autocast(bf16): fp32 params/grads/optimizer, bf16 matmul outputs; the loss is fp32
    "amp-bf16": Precision(4, 4, 0, 2, 2, 14, 6),
    # what-if, not what preinfer's trainer does: bf16 params/grads + fp32 master of the active block
    "bf16": Precision(2, 2, 4, 2, 0, 14, 6),
}
# Optimizer state bytes per active parameter, and update temporaries (x largest tensor on CPU's
# per-tensor loop, x all active params on GPU's foreach path): adam adds the weight-decay copy.
OPT_STATE = {"sgd": 4, "adam": 8, "adamw": 8}
OPT_TEMP = {"cpu": {"sgd": 1, "adam": 3, "adamw": 2}, "gpu": {"sgd": 1, "adam": 1, "adamw": 1}}
# CPU-only constants, measured (not derived) by `bench/plan_accuracy.py --calibrate` on a minimal
# model and on configs/llama-small.yaml at two shard sizes, never on the configs the bench
# validates (demo, gpt2-small). Re-measure when storage/ or the libraries change.
# RUNTIME: fixed peak-RSS growth of each code path. CPU_ALLOC: RSS per live byte of activations
# (glibc keeps the forward's freed temporaries in its heap). CPU_INFER: the same for the bf16
# inference working set. HOST_IO: (fixed bytes, RSS per byte) of the data a reader or writer
# holds: decode, copies, and the codec threads' malloc arenas. On a GPU machine those buffers
# are host RAM, not card memory; the GPU runtime row (CUDA context + cuBLAS workspace) is an
# assumption, not measured here.
RUNTIME = {
    ("cpu", "trainer"): 59 * MiB,
    ("cpu", "trainer-cache"): 55 * MiB,
    ("cpu", "preinfer"): 52 * MiB,
    ("gpu", "trainer"): 768 * MiB,
    ("gpu", "trainer-cache"): 768 * MiB,
    ("gpu", "preinfer"): 768 * MiB,
}
CPU_ALLOC = 1.28
CPU_INFER = 1.49
HOST_IO = {
    "token_read": (0, 6.5),  # one token-store shard (data.shard_rows x (S+1) int32), Parquet
    "cache_read": (0, 1.79),  # the reader's stored rows (shuffle buffer + the shard being read)
    "cache_write": (41 * MiB, 0.69),  # one cache shard (stored dtype): encode, checksum, compress
}


def host_io(kind: str, nbytes: float) -> float:
    """Peak-RSS bytes of a host-side reader/writer holding `nbytes` (0 when it holds none)."""
    fixed, per = HOST_IO[kind]
    return fixed + per * nbytes if nbytes else 0.0


# name: (memory GiB, dense peak TFLOPS fp32, bf16 tensor, USD per GPU-hour or None).
# Prices: the paper's rental figures (sec. 4.3.1); peaks: vendor datasheets (no sparsity).
CARDS = {
    "rtx4090": (24, 82.6, 165.2, 0.29),
    "a100-80": (80, 19.5, 312.0, 1.20),
    "a800-80": (80, 19.5, 312.0, 0.69),
    "h100-80": (80, 67.0, 989.0, None),
}


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need of a model, read off its meta-device build."""

    arch: str
    hidden: int
    vocab: int
    heads: int
    kv_dim: int  # key/value width (GQA: kv_heads * head_dim)
    inter: int  # MLP width
    embed: int  # parameters owned by the embedding
    layers: tuple[int, ...]  # parameters per layer
    head: int  # parameters owned by the head (tied matrix excluded)
    head_matrix: int  # elements of the LM-head matrix (V x H), owned or tied
    tied: bool
    max_tensor: int  # largest single tensor (elements)
    max_layer_tensor: int  # largest tensor inside a layer

    @property
    def params(self) -> int:
        return self.embed + sum(self.layers) + self.head


def model_shape(model_cfg) -> ModelShape:
    """Shapes of `model_cfg` from a meta-device build (no weight memory, any size)."""
    from preinfer.adapters import get_adapter
    from preinfer.modeling import build_model, default_intermediate

    model = build_model(model_cfg, device="meta")
    ad = get_adapter(model, model_cfg.arch)
    embed, layers, head = ad.part_params()
    hf = getattr(model, "config", None)
    if hf is None:  # arch sequential
        H, heads, inter = (
            model_cfg.hidden_size,
            model_cfg.num_heads,
            default_intermediate(model_cfg),
        )
        kv = H
    else:
        H, heads = hf.hidden_size, hf.num_attention_heads
        inter = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * H
        kv = (getattr(hf, "num_key_value_heads", None) or heads) * (H // heads)
    t, tied = ad.tensors(), ad.tied()
    matrix = max(
        (v.numel() for n, v in t.items() if ad.part_of(n)[0] == "head" and v.ndim == 2), default=0
    )
    return ModelShape(arch=model_cfg.arch, hidden=H, vocab=ad.vocab_size, heads=heads,
                      kv_dim=kv, inter=inter, embed=embed, layers=tuple(layers), head=head,
                      head_matrix=matrix, tied=bool(tied),
                      max_tensor=max(v.numel() for v in t.values()),
                      max_layer_tensor=max(t[n].numel() for n in ad.part_names()["layers"][0]))  # fmt: skip


# ---------------------------------------------------------------------------- activations


def layer_act(sh: ModelShape, trainable: bool) -> int:
    """Activation elements autograd saves per token for one layer. Trainable layers also keep
    every matmul input (for weight gradients); frozen ones only what input gradients need."""
    H, F, KV = sh.hidden, sh.inter, sh.kv_dim
    if sh.arch == "gpt2":  # LN in x2, c_attn in, qkv, sdpa out, LN2 in, c_fc in; gelu_new: 5 x F
        e = 8 * H + 5 * F if trainable else 6 * H + 4 * F
    elif sh.arch == "llama":  # RMSNorm x, normed, out (x2); q, k, v, sdpa out; SwiGLU 4 x F
        e = 8 * H + 2 * KV + 4 * F if trainable else 4 * H + 2 * KV + 3 * F
    elif sh.arch == "bert":
        e = 8 * H + 2 * F if trainable else 6 * H + F
    else:  # sequential residual MLP: LN in, fc1 in, gelu in, fc2 in
        e = 2 * H + 2 * F if trainable else H + F
    return e + sh.heads + 4  # + LN statistics and the attention log-sum-exp per head


def head_act(sh: ModelShape, norm_trainable: bool, matrix_trainable: bool) -> int:
    """Elements per token saved by the final norm and LM head (logits counted separately)."""
    H = sh.hidden
    if sh.arch == "bert":
        return 4 * sh.hidden if matrix_trainable else 2 * sh.hidden
    extra = H if (sh.arch == "llama" and norm_trainable) else 0
    return H + 2 + extra + (H if matrix_trainable else 0)


def infer_act(sh: ModelShape) -> int:
    """Inference-mode working set per token inside one layer (intermediates freed eagerly)."""
    return 4 * sh.hidden + 3 * sh.inter


# ---------------------------------------------------------------------------- trainer


@dataclass(kw_only=True)
class Setup:
    """Everything the memory model needs besides the shapes (per card)."""

    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: bool = True
    """SGD keeps a momentum buffer (momentum > 0)."""
    batch: int = 1
    """Sequences per card per step."""
    seq: int = 128
    target: str = "gpu"
    """gpu or cpu: decides the fixed overhead and the optimizer's update path."""
    act_recompute: bool = False
    """What-if: keep only each layer's input and recompute the layer in backward."""
    world: int = 1
    """Data-parallel replicas (a flat all-reduce buffer of the gradients when > 1)."""
    reader_rows: int = 0
    """Rows of stored cache values the trainer's shuffle buffer holds (bcd K > 0)."""
    val_rows: int = 0
    cache_dtype_bytes: int = 2
    shard_rows: int = 1
    """Rows per cache shard the pre-inference worker computes and encodes at once."""
    token_rows: int = 4096
    """Rows of the token-store shard the token reader decodes at once (data.shard_rows)."""
    micro_batch: int = 16


def _bytes(p: Setup) -> Precision:
    return PRECISIONS[p.precision]


def _sweep(sh, layers, trainable, head_norm_tr, matrix_tr, embed_tr, p: Setup):
    """Peak of saved activations + gradients through one forward/backward, and its split.

    Backward walks from the loss down: the loss peak holds every saved activation plus four
    logit-sized tensors (logits, log-softmax output, and both gradients); then each layer's
    activations are released as its parameter gradients appear."""
    pr, T = _bytes(p), p.batch * p.seq
    TV = T * sh.vocab
    cast = lambda n: pr.cast * n  # noqa: E731  (autocast's bf16 weight copies, saved for bwd)
    acts = []
    for j in layers:
        a = T * layer_act(sh, trainable[j]) * pr.act + cast(sh.layers[j])
        acts.append((a, T * sh.hidden * pr.act + cast(sh.layers[j])) if p.act_recompute else (a, a))
    grads = [pr.grad * sh.layers[j] if trainable[j] else 0 for j in layers]
    a_head = T * head_act(sh, head_norm_tr, matrix_tr) * pr.act + cast(sh.head_matrix)
    g_head = pr.grad * ((sh.head if head_norm_tr else 0) + (sh.head_matrix if matrix_tr else 0))
    stored = sum(s for _, s in acts)
    points = [(stored + a_head + TV * pr.logit, stored + a_head + TV * pr.logit, 0)]
    live_g = g_head
    ws = T * (2 * sh.hidden + 2 * sh.inter) * pr.act  # gradients flowing through one layer
    for i in range(len(layers) - 1, -1, -1):
        full, kept = acts[i]
        below = sum(s for _, s in acts[:i])
        live_g += grads[i]
        act = below + full + ws + TV * pr.keep
        points.append((act + live_g, act, live_g))
    if embed_tr:  # the embedding gradient (+ a dense V x H scatter buffer when tied)
        e = pr.grad * (sh.embed - (sh.head_matrix if sh.tied else 0))
        extra = pr.grad * sh.head_matrix if sh.tied else 0
        points.append((live_g + e + extra + TV * pr.keep, TV * pr.keep, live_g + e + extra))
    return max(points)


def trainer_memory(sh: ModelShape, part, mode: str, block: int, p: Setup) -> dict:
    """Peak bytes per card of one visit (mode full or bcd block K), with its breakdown and the
    raw terms (`basis`) the calibration divides by."""
    pr, M, cpu = _bytes(p), part.num_blocks, p.target == "cpu"
    first = 0 if mode == "full" or block == 0 else part.blocks[block][0]
    # bcd-recompute loads the prefix too and reruns it without grad (nothing saved)
    loaded_blocks = range(M) if first == 0 or mode == "bcd-recompute" else range(block, M)
    active = range(M) if mode == "full" else [block]
    layers = list(range(first, part.num_layers))
    trainable = {j: part.block_of_layer(j) in active for j in layers}
    embed_tr, head_tr = 0 in active, (M - 1) in active
    matrix_tr = (head_tr and not sh.tied) or (sh.tied and embed_tr)
    n_loaded = sum(part.block_params[b] for b in loaded_blocks)
    if loaded_blocks[0] > 0 and sh.tied:
        n_loaded += sh.head_matrix  # the tied matrix, read from block 0's file for the head
    n_active = sum(part.block_params[b] for b in active)
    W, G = pr.weight * n_loaded, pr.grad * n_active
    state = OPT_STATE[p.optimizer] if (p.optimizer != "sgd" or p.momentum) else 0
    opt = (state + pr.master) * n_active
    _, act, grads = _sweep(sh, layers, trainable, head_tr, matrix_tr, embed_tr, p)
    ev = 2 * p.batch * p.seq * sh.vocab * 4  # eval: logits + log-softmax, no saved activations
    from_cache = mode == "bcd" and block > 0
    row = p.seq * sh.hidden * p.cache_dtype_bytes  # one sample as the cache stores it
    # train: the shuffle buffer + the shard being read into it; val (in order): one shard
    # buffered + the shard being read; each batch decoded to fp32 (b rows)
    dec = 2 * p.batch * p.seq * sh.hidden * 4
    buf = (
        ((p.reader_rows + p.shard_rows) * row + dec, 2 * p.val_rows * row + dec)
        if from_cache
        else (0, 0)
    )
    tok = 0 if from_cache else p.token_rows * (p.seq + 1) * 4
    alloc, reader, val = 1.0, 0.0, 0.0
    if cpu:  # on a GPU machine these buffers are host RAM
        alloc = CPU_ALLOC
        reader = host_io("cache_read", buf[0]) + host_io("token_read", tok)
        val = HOST_IO["cache_read"][1] * buf[1]
    temp = OPT_TEMP["cpu" if cpu else "gpu"][p.optimizer] * 4 * (sh.max_tensor if cpu else n_active)
    phases = {
        "backward": dict(weights=W, optimizer=opt, activations=alloc * act, grads=grads,
                         reader=reader),
        "step": dict(weights=W, optimizer=opt + temp, grads=G + (G if p.world > 1 else 0),
                     reader=reader),
        "eval": dict(weights=W, optimizer=opt, grads=G, reader=reader + val,
                     activations=alloc * ev),
    }  # fmt: skip
    if cpu:  # the checkpoint hash copies each tensor's bytes once
        phases["load"] = dict(weights=W + 4 * sh.max_tensor)
    name, comp = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    comp = {k: comp.get(k, 0) for k in ("weights", "grads", "optimizer", "activations", "reader")}
    comp["runtime"] = RUNTIME[
        ("cpu" if cpu else "gpu", "trainer-cache" if from_cache else "trainer")
    ]
    basis = {"static": W + opt, "act": act, "grads": grads, "cache_buffer": buf[0],
             "val_buffer": buf[1], "token_shard": tok}  # fmt: skip
    return {"stage": "full" if mode == "full" else f"{mode} block {block}", "mode": mode,
            "block": block, "phase": name, "peak": sum(comp.values()), "components": comp,
            "loaded_params": n_loaded, "active_params": n_active,
            "loaded_blocks": list(loaded_blocks), "basis": basis}  # fmt: skip


def preinfer_memory(sh: ModelShape, part, block: int, p: Setup, *, refresh: bool = False) -> dict:
    """Peak bytes of one pre-inference worker producing boundary `block` (build: prefix blocks
    0..K-1 from tokens; refresh: block K-1 alone from the boundary K-1 cache)."""
    cpu = p.target == "cpu"
    blocks = [block - 1] if refresh else list(range(block))
    n = sum(part.block_params[b] for b in blocks)
    cb = p.cache_dtype_bytes if p.cache_dtype_bytes in (2, 4) else 4  # int8/fp8: fp32 compute
    work = p.micro_batch * p.seq * infer_act(sh) * cb
    shard = p.shard_rows * p.seq * sh.hidden * cb
    phases = {"compute": dict(weights=cb * n, activations=work)}
    if cpu:  # outputs (list, then concatenated), the encode and a refresh's source: host RAM
        src = 2 * shard if refresh else 0  # the source shard: stored bytes + decoded
        big = sh.max_tensor if 0 in blocks else sh.max_layer_tensor
        phases = {
            "load": dict(weights=4 * n + 4 * big),  # fp32 from the file + the hash's byte copy
            "compute": dict(weights=cb * n, activations=CPU_INFER * work, shard=2 * shard + src),
            "encode": dict(weights=cb * n, shard=shard + host_io("cache_write", shard) + src),
        }
    name, comp = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    comp = {k: comp.get(k, 0) for k in ("weights", "activations", "shard")}
    comp["runtime"] = RUNTIME[("cpu" if cpu else "gpu", "preinfer")]
    return {"stage": f"pre-inference {'refresh' if refresh else 'build'} -> boundary {block}",
            "block": block, "refresh": refresh, "phase": name, "peak": sum(comp.values()),
            "components": comp, "prefix_params": n,
            "basis": {"weights": cb * n, "work": work, "shard": shard}}  # fmt: skip


def sharded_full_cards(sh: ModelShape, part, p: Setup, card_bytes: float, global_batch: int,
                       limit: int = 256) -> int | None:  # fmt: skip
    """Smallest n whose per-card peak fits when full training shards weights, gradients and
    optimizer state n ways and splits the global batch n ways (a ZeRO-3 idealisation, for the
    cost baseline; preinfer's own full mode is a DDP replica). None if nothing up to `limit`."""
    for n in range(1, limit + 1):
        q = Setup(**{**p.__dict__, "batch": max(1, math.ceil(global_batch / n)), "world": n})
        r = trainer_memory(sh, part, "full", 0, q)
        c = r["components"]
        if r["peak"] - (c["weights"] + c["optimizer"] + c["grads"]) * (1 - 1 / n) <= card_bytes:
            return n
    return None


@dataclass(kw_only=True)
class Flops:
    """Matmul FLOPs per token (2 per multiply-add; backward = 2 x forward)."""

    sh: ModelShape
    part: object
    seq: int

    def _fwd(self, layers) -> float:
        H, S = self.sh.hidden, self.seq
        return sum(2 * self.sh.layers[j] + 4 * S * H for j in layers)

    def full(self) -> float:
        layers = range(self.part.num_layers)
        return 3 * (self._fwd(layers) + 2 * self.sh.head_matrix)

    def bcd(self, k: int) -> float:
        """Suffix forward + input gradients through it + weight gradients of block k only."""
        M, part = self.part.num_blocks, self.part
        suffix = range(part.blocks[k][0], part.num_layers)
        fwd = self._fwd(suffix) + 2 * self.sh.head_matrix
        matrix_tr = (k == M - 1 and not self.sh.tied) or (k == 0 and self.sh.tied)
        wgrad = self._fwd(part.layers(k)) + (2 * self.sh.head_matrix if matrix_tr else 0)
        return 2 * fwd + wgrad

    def preinfer(self, k: int) -> float:
        """Refresh of boundary k: block k-1's forward per cached token."""
        return self._fwd(self.part.layers(k - 1))


def smallest_fitting_m(sh: ModelShape, p: Setup, card_bytes: float) -> dict | None:
    """Smallest M whose worst BCD block fits `card_bytes` (block 0 holds every weight)."""
    from preinfer.partition import partition_layers

    L = len(sh.layers)

    def worst(m):
        part = partition_layers(list(sh.layers), sh.embed, sh.head, m)
        r = max((trainer_memory(sh, part, "bcd", k, p) for k in range(m)), key=lambda r: r["peak"])
        return {"M": m, "peak": r["peak"], "worst_stage": r["stage"],
                "blocks": [list(b) for b in part.blocks]}  # fmt: skip

    if worst(L)["peak"] > card_bytes:  # one layer per block does not fit: no M will
        return None
    return next(w for m in range(1, L + 1) if (w := worst(m))["peak"] <= card_bytes)


def setup_for(cfg, sh: ModelShape, *, target: str, batch: int | None = None,
              seq: int | None = None, cards: int = 1, precision: str | None = None,
              optimizer: str | None = None, act_recompute: bool = False,
              n_train: int | None = None, n_val: int | None = None) -> Setup:  # fmt: skip
    """The per-card Setup of a config: batch split over `cards` data-parallel replicas, precision
    from run.precision (auto: amp-bf16 on GPU, fp32 on CPU), cache reader/worker buffers from
    cache.shard_mb (N unknown: assume at least one full shard)."""
    from storage.cache import rows_per_shard
    from storage.codecs import stored_dtype

    S = seq or cfg.data.seq_len
    B = batch or cfg.train.batch_size
    b = max(1, math.ceil(B / cards))
    if precision is None:
        rp = cfg.run.precision
        precision = "fp32" if rp == "fp32" or (target == "cpu" and rp == "auto") else "amp-bf16"
    rps = rows_per_shard(S, sh.hidden, cfg.cache.dtype, cfg.cache.shard_mb)
    n_tr = None if n_train is None else max(1, round(n_train * cfg.preinfer.sample_fraction))
    tr_rows = rps if n_tr is None else min(rps, n_tr)
    # the trainer's shuffle buffer (storage.reader.buffer_rows): train.shuffle_buffer_mb of
    # stored rows, at least one shard, at most the rank's rows (N unknown: the full budget)
    row_stored = S * sh.hidden * stored_dtype(cfg.cache.dtype).itemsize
    buf_rows = max(int(cfg.train.shuffle_buffer_mb * MiB // row_stored), rps)
    if n_tr is not None:
        buf_rows = min(buf_rows, math.ceil(n_tr / cards))
    val_rows = rps if n_val is None else min(rps, n_val)
    opt = optimizer or cfg.train.optimizer
    return Setup(precision=precision, optimizer=opt, momentum=cfg.train.momentum != 0,
                 batch=b, seq=S, target=target, act_recompute=act_recompute, world=cards,
                 reader_rows=max(buf_rows, b), val_rows=max(val_rows, min(B, n_val or B)),
                 cache_dtype_bytes=stored_dtype(cfg.cache.dtype).itemsize, shard_rows=tr_rows,
                 token_rows=min(cfg.data.shard_rows, n_train or cfg.data.shard_rows),
                 micro_batch=cfg.preinfer.micro_batch)  # fmt: skip


# ---------------------------------------------------------------------------- the plan


@dataclass(kw_only=True)
class PlanOptions:
    """`preinfer plan` options (command line only; the config supplies everything else)."""

    card: str = "rtx4090"
    """Card type: rtx4090, a100-80, a800-80, h100-80 (memory, peak FLOPS, price), or cpu."""
    gpu_mem: float | None = None
    """Memory per card in GiB; null = the card's (cpu: this machine's RAM)."""
    cards: int = 1
    """Cards training data-parallel (the global batch is split over them)."""
    price: float | None = None
    """USD per card-hour; null = the card's (the paper's rental prices)."""
    peak_tflops: float | None = None
    """Card peak TFLOPS in the planned precision; null = the card's datasheet figure."""
    mfu: float = 0.4
    """Fraction of the peak a step reaches, for FLOP-estimated step times (an assumption)."""
    precision: str | None = None
    """fp32, amp-bf16 (autocast: fp32 weights) or bf16 (what-if); null = from run.precision."""
    optimizer: str | None = None
    """sgd, adam or adamw; null = train.optimizer."""
    batch: int | None = None
    """Global batch in sequences; null = train.batch_size."""
    seq: int | None = None
    """Sequence length S; null = data.seq_len."""
    blocks: int | None = None
    """M, the number of BCD blocks; null = partition.num_blocks."""
    act_recompute: bool = False
    """What-if: activation recomputation (keep layer inputs only; preinfer does not do this)."""
    steps: int | None = None
    """Full-training steps to the target loss; null = train.max_steps x rounds x M."""
    bf_average: float = 1.39
    """BCD/full step multiplier, average (the paper's Adam figure)."""
    bf_worst: float = 2.89
    """BCD/full step multiplier, worst case (the paper's Adam figure)."""
    samples: int | None = None
    """Train samples (for cache size and pre-inference time); null = the token store's."""
    tokens: float | None = None
    """Train tokens instead of samples (samples = tokens / S)."""
    free_disk: float | None = None
    """Free disk in GiB at cache.root; null = measured."""
    flops_only: bool = False
    """Ignore step times measured in <run.dir>/metrics.jsonl (they assume the same hardware)."""
    compare_card: str | None = None
    """Also cost full training on this card type: the card-change factor, reported apart."""
    compare_price: float | None = None
    """USD per card-hour of the compare card; null = its listed price."""
    json: bool = False
    """Print the plan as JSON."""


def add_plan_arguments(parser) -> None:
    """One --option per PlanOptions field (help = the field's docstring)."""
    import dataclasses
    import typing

    from preinfer.confload import field_docs

    docs, hints = field_docs(PlanOptions), typing.get_type_hints(PlanOptions)
    for f in dataclasses.fields(PlanOptions):
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            parser.add_argument(flag, action="store_true", help=docs[f.name])
            continue
        tp = next(
            t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)
        )
        parser.add_argument(flag, type=tp, default=f.default, help=docs[f.name])


def _card(name: str, mem=None, peak=None, price=None, precision="fp32"):
    """(memory bytes, {"train", "infer"}: peak FLOP/s or None, price or None) of a card name
    with overrides; training runs at the planned precision, pre-inference in bf16."""
    from preinfer.confload import ConfigError

    if name == "cpu":
        import psutil

        m, fp32, bf16, pr = psutil.virtual_memory().total / GiB, None, None, None
    elif name in CARDS:
        m, fp32, bf16, pr = CARDS[name]
    else:
        raise ConfigError(f"--card {name!r} is unknown; choose one of cpu, {', '.join(CARDS)}")
    train = peak if peak is not None else (fp32 if precision == "fp32" else bf16)
    peaks = {"train": train and train * 1e12, "infer": bf16 and bf16 * 1e12}
    return (mem if mem is not None else m) * GiB, peaks, (price if price is not None else pr)


def measured_times(cfg) -> dict:
    """Seconds per global token of the latest visits in <run.dir>/metrics.jsonl, per stage."""
    import json
    from pathlib import Path

    path, out = Path(cfg.run.dir) / "metrics.jsonl", {}
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            ok = rec.get("event") == "visit" and rec.get("tokens_per_s")
            if ok and rec["mode"] in ("full", "bcd"):
                key = "full" if rec["mode"] == "full" else f"bcd {rec['block']}"
                out[key] = 1.0 / rec["tokens_per_s"]
    return out


def _n_samples(cfg, o: PlanOptions, seq: int) -> tuple[int | None, int | None, str]:
    """(train, val) samples and where they came from: --samples/--tokens, else the token store."""
    from storage.tokens import TokenStore

    if o.samples or o.tokens:
        n = o.samples or max(1, int(o.tokens // seq))
        return n, max(1, round(n * cfg.data.val_fraction)), "given"
    if TokenStore.exists(cfg.data.out_dir):
        st = TokenStore(cfg.data.out_dir)
        scale = st.seq_len / seq  # same tokens, repacked at the planned S
        return (round(st.num_samples("train") * scale), round(st.num_samples("val") * scale),
                f"token store {cfg.data.out_dir}")  # fmt: skip
    return None, None, "unknown (tokenize first, or pass --samples / --tokens)"


def build_plan(cfg, o: PlanOptions) -> dict:
    """The whole plan as plain data (what --json prints)."""
    from preinfer.confload import ConfigError
    from preinfer.partition import partition_layers

    if o.cards < 1 or o.mfu <= 0 or (o.precision and o.precision not in PRECISIONS):
        raise ConfigError(f"plan: need --cards >= 1, --mfu > 0, --precision in {list(PRECISIONS)}")
    if o.optimizer and o.optimizer not in OPT_STATE:
        raise ConfigError(f"plan: --optimizer must be one of {', '.join(OPT_STATE)}")
    target = "cpu" if o.card == "cpu" else "gpu"
    sh = model_shape(cfg.model)
    S = o.seq or cfg.data.seq_len
    M = o.blocks or cfg.partition.num_blocks
    if not 1 <= M <= len(sh.layers):
        raise ConfigError(f"plan: M={M} blocks is out of range 1..{len(sh.layers)} layers")
    part = partition_layers(list(sh.layers), sh.embed, sh.head, M)
    n_tr, n_val, n_src = _n_samples(cfg, o, S)
    p = setup_for(cfg, sh, target=target, batch=o.batch, seq=S, cards=o.cards,
                  precision=o.precision, optimizer=o.optimizer, act_recompute=o.act_recompute,
                  n_train=n_tr, n_val=n_val)  # fmt: skip
    mem, peak, price = _card(o.card, o.gpu_mem, o.peak_tflops, o.price, p.precision)
    stages = [trainer_memory(sh, part, "full", 0, p)]
    stages += [trainer_memory(sh, part, "bcd", k, p) for k in range(M)]
    stages += [preinfer_memory(sh, part, k, p) for k in range(1, M)]
    stages += [preinfer_memory(sh, part, k, p, refresh=True) for k in range(2, M)]
    for s in stages:
        s["fits"] = s["peak"] <= mem
    bcd = [s for s in stages if s.get("mode") == "bcd"]
    plan = {
        "model": {"arch": sh.arch, "layers": len(sh.layers), "hidden": sh.hidden,
                  "vocab": sh.vocab, "params": sh.params, "tied": sh.tied},
        "partition": {"M": M, "blocks": [list(b) for b in part.blocks],
                      "block_params": part.block_params},
        "setup": {**p.__dict__, "global_batch": p.batch * o.cards,
                  "card": o.card, "card_bytes": mem, "cards": o.cards},
        "stages": stages,
        "full_fits": stages[0]["fits"], "bcd_fits": all(s["fits"] for s in bcd),
        "smallest_m": smallest_fitting_m(sh, p, mem),
        "samples": {"train": n_tr, "val": n_val, "source": n_src},
    }  # fmt: skip
    plan["cache"] = _cache(cfg, o, sh, S, M, n_tr, n_val)
    plan["cost"] = _cost(cfg, o, sh, part, p, plan, peak, price, n_tr)
    return plan


def _cache(cfg, o, sh, S, M, n_tr, n_val) -> dict:
    from preinfer.guards import cache_bytes
    from storage.cache import free_disk_bytes

    free = o.free_disk * GiB if o.free_disk is not None else free_disk_bytes(cfg.cache.root)
    if n_tr is None:
        one = cache_bytes(cfg, hidden=sh.hidden, seq=S, n_train=1000, n_val=0)
        return {"per_1000_samples": one, "free": free, "boundaries_at_once": None}
    per = cache_bytes(cfg, hidden=sh.hidden, seq=S, n_train=n_tr, n_val=n_val)
    alive = 0 if M < 2 else (M - 1 if cfg.cache.keep else min(2, M - 1))
    return {"per_boundary": per, "boundaries_at_once": alive, "peak_disk": alive * per["expected"],
            "free": free, "fits": alive * per["expected"] <= free}  # fmt: skip


def _cost(cfg, o, sh, part, p, plan, peak, price, n_tr) -> dict:
    """steps x time per step x cards x price, full vs BCD, same card; optionally full on another."""
    M, tok = part.num_blocks, p.batch * o.cards * p.seq  # tokens per global step
    fl = Flops(sh=sh, part=part, seq=p.seq)
    measured = {} if o.flops_only else measured_times(cfg)
    steps = o.steps or cfg.train.max_steps * cfg.train.rounds * M

    def step_time(key, flops, cards, peak_):
        if key in measured:
            return tok * measured[key], "measured"
        return (None, "n/a") if not peak_ else (flops * tok / (cards * peak_ * o.mfu), "flops")

    def full_on(mem_, peak_, price_):  # preinfer's DDP replica if it fits, else sharded
        fits = trainer_memory(sh, part, "full", 0, p)["peak"] <= mem_
        n = o.cards if fits else sharded_full_cards(sh, part, p, mem_, p.batch * o.cards)
        t, src = step_time("full", fl.full(), n or 1, peak_["train"])
        hours = None if t is None or n is None else steps * t / 3600
        return {"cards": n, "sharded": not fits, "step_s": t, "time_source": src, "hours": hours,
                "cost": None if hours is None or price_ is None else hours * n * price_}  # fmt: skip

    out = {"steps_full": steps, "mfu": o.mfu, "price": price,
           "full": full_on(plan["setup"]["card_bytes"], peak, price)}  # fmt: skip
    times = [step_time(f"bcd {k}", fl.bcd(k), o.cards, peak["train"]) for k in range(M)]
    pre = None
    cached = round(n_tr * cfg.preinfer.sample_fraction) if n_tr else None
    if cached and peak["infer"] and M > 1:  # per round: each boundary refreshed once, in bf16
        pre = sum(fl.preinfer(k) for k in range(1, M)) * cached * p.seq
        pre /= o.cards * peak["infer"] * o.mfu
    read = steps / M / cfg.train.rounds * p.batch * o.cards  # samples one block visit reads
    out["cache_use"] = {"cached_per_boundary": cached, "read_per_visit": round(read)}
    for name, bf in (("bcd_average", o.bf_average), ("bcd_worst", o.bf_worst)):
        if any(t is None for t, _ in times):
            out[name] = {"multiplier": bf, "hours": None, "cost": None}
            continue
        rounds = cfg.train.rounds * bf
        secs = steps * bf / M * sum(t for t, _ in times) + (pre or 0) * rounds
        hours = secs / 3600
        out[name] = {"multiplier": bf, "cards": o.cards, "hours": hours,
                     "time_source": sorted({s for _, s in times}),
                     "preinfer_hours": None if pre is None else pre * rounds / 3600,
                     "cost": None if price is None else hours * o.cards * price}  # fmt: skip
        f = out["full"]["cost"]
        out[name]["same_device_factor"] = out[name]["cost"] / f if f and out[name]["cost"] else None
    if o.compare_card:
        m2, pk2, pr2 = _card(o.compare_card, price=o.compare_price, precision=p.precision)
        other = full_on(m2, pk2, pr2)
        here, there = out["full"]["cost"], other["cost"]
        out["compare"] = {"card": o.compare_card, "full": other,
                          "card_change_factor": here / there if here and there else None}  # fmt: skip
    return out


def _usd(x) -> str:
    return "-" if x is None else f"${x:,.2f}" if x < 100 else f"${x:,.0f}"


def _gib(b) -> str:
    return "-" if b is None else f"{b / GiB:.2f}" if b < 10 * GiB else f"{b / GiB:.1f}"


def format_plan(plan: dict) -> str:
    """The human report: model, per-stage memory table, smallest M, cache vs disk, cost."""
    m, st, c = plan["model"], plan["setup"], plan["cost"]
    part = plan["partition"]
    blocks = " | ".join(f"{a}-{b - 1}" for a, b in part["blocks"])
    where = (
        "CPU runtime constants measured" if st["target"] == "cpu" else "GPU, CUDA context assumed"
    )
    out = [
        f"model  {m['arch']} L={m['layers']} H={m['hidden']} V={m['vocab']}: "
        f"{m['params'] / 1e9:.3g} B params{' (tied head)' if m['tied'] else ''}; "
        f"M={part['M']} blocks, layers {blocks}",
        f"card   {st['card']} {st['card_bytes'] / GiB:.1f} GiB x {st['cards']}; precision "
        f"{st['precision']}, {st['optimizer']}; {st['batch']} x {st['seq']} tokens per card "
        f"(global batch {st['global_batch']}); activation recompute "
        f"{'on (what-if)' if st['act_recompute'] else 'off'}",
        f"memory estimated per card, GiB ({where}; see preinfer/plan.py)",
        "",
        f"{'stage':36s} {'weights':>8s} {'grads':>7s} {'optim':>7s} {'activ':>7s} "
        f"{'host io':>8s} {'runtime':>8s} {'PEAK':>8s}  phase     fits",
    ]
    for s in plan["stages"]:
        cp = s["components"]
        io = cp.get("reader", 0) + cp.get("shard", 0)
        out.append(
            f"{s['stage']:36s} {_gib(cp['weights']):>8s} {_gib(cp.get('grads')):>7s} "
            f"{_gib(cp.get('optimizer')):>7s} {_gib(cp['activations']):>7s} {_gib(io):>8s} "
            f"{_gib(cp['runtime']):>8s} {_gib(s['peak']):>8s}  {s['phase']:9s} "
            f"{'yes' if s['fits'] else 'NO'}"
        )
    sm = plan["smallest_m"]
    out += ["", f"full-parameter training fits one card: {'yes' if plan['full_fits'] else 'NO'}; "
            f"BCD with M={part['M']} fits: {'yes' if plan['bcd_fits'] else 'NO'}; smallest M that "
            "fits: " + (f"{sm['M']} (worst: {sm['worst_stage']}, {_gib(sm['peak'])} GiB)" if sm
                        else "none (block 0 holds every weight and the whole model's activations: "
                        "lower the batch or S)")]  # fmt: skip
    ca, n = plan["cache"], plan["samples"]
    if "per_boundary" in ca:
        per = ca["per_boundary"]
        basis = (
            f"codec ratio {per['ratio']:.2f} measured on cache {per['ratio_source'][:12]}"
            if per["ratio"]
            else "uncompressed upper bound (no cache of this codec yet)"
        )
        out += ["", f"cache  per boundary {_gib(per['expected'])} GiB for {per['samples']} samples "
                f"({n['source']}; {basis}); {ca['boundaries_at_once']} boundaries on disk at once "
                f"= {_gib(ca['peak_disk'])} GiB; free {_gib(ca['free'])} GiB: "
                f"{'ok' if ca['fits'] else 'DOES NOT FIT'}"]  # fmt: skip
    else:
        out += ["", f"cache  {_gib(ca['per_1000_samples']['expected'])} GiB per 1000 samples; "
                f"sample count {n['source']}"]  # fmt: skip
    price = "-" if c["price"] is None else f"${c['price']:.2f}"
    out += ["", f"cost   {c['steps_full']} full-training steps; {price}/card-hour; step times: "
            "measured (metrics.jsonl) where present, else FLOPs / (card peak x MFU "
            f"{c['mfu']}): an estimate that ignores communication"]  # fmt: skip
    rows = [("full", c["full"])] + [
        (k.replace("_", " "), c[k]) for k in ("bcd_average", "bcd_worst")
    ]
    if "compare" in c:
        rows.append((f"full on {c['compare']['card']}", c["compare"]["full"]))
    for name, r in rows:
        h, cost = r.get("hours"), r.get("cost")
        src = r.get("time_source")
        extra = f" x{r['multiplier']} steps" if "multiplier" in r else ""
        extra += f" [time: {'+'.join(src) if isinstance(src, list) else src}]" if src else ""
        extra += " (states sharded, ZeRO-3 idealisation)" if r.get("sharded") else ""
        if r.get("preinfer_hours"):
            extra += f", of which pre-inference {r['preinfer_hours']:,.1f} h"
        extra += (f", same-device factor {r['same_device_factor']:.2f}"
                  if r.get("same_device_factor") else "")  # fmt: skip
        out.append(f"  {name:22s} cards {r.get('cards') or '-'}  hours "
                   f"{'-' if h is None else f'{h:,.1f}'}  cost {_usd(cost)}{extra}")  # fmt: skip
    use = c["cache_use"]
    if use["cached_per_boundary"] and use["cached_per_boundary"] > 2 * use["read_per_visit"]:
        frac = use["read_per_visit"] / use["cached_per_boundary"]
        out.append(f"  note: each round caches {use['cached_per_boundary']:,} samples per boundary "
                   f"but a block visit reads ~{use['read_per_visit']:,}: "
                   f"preinfer.sample_fraction ~ {frac:.2g} would cut pre-inference accordingly")  # fmt: skip
    if c.get("compare", {}).get("card_change_factor"):
        out.append(
            f"  card-change factor (full here / full on {c['compare']['card']}): "
            f"{c['compare']['card_change_factor']:.2f}; BCD here vs full there = "
            "same-device factor x card-change factor"
        )
    return "\n".join(out)


def run_plan(cfg, args) -> int:
    """`preinfer plan`: options from argparse (see add_plan_arguments), print, exit code 0."""
    import dataclasses
    import json

    o = PlanOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PlanOptions)})
    plan = build_plan(cfg, o)
    print(json.dumps(plan, indent=1, default=str) if o.json else format_plan(plan))
    return 0
