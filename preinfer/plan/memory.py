"""Memory arithmetic of `preinfer plan`: per-card peaks of the trainer and the pre-inference worker.

Pure arithmetic over the model's shapes (read off a meta-device build: no weight memory, so
7B/20B configs are fine) and the config. Memory is per card, the peak over the phases of one
visit, each phase a sum of what is alive then:

  trainer   backward  weights of the loaded blocks + optimizer state + saved activations,
                      swept from the loss down as activations turn into gradients (the loss
                      peak: the fused chunked loss holds one chunk's logits twice in fp32 and
                      keeps d loss / d (head input, head matrix); the plain loss (loss_chunk
                      0) holds four logit-sized fp32 tensors: logits, log-softmax, 2 grads)
            step      + all gradients of the active block + the optimizer's temporaries
            eval      + the eval forward (bcd K > 0 on CPU: + the val cache reader; on CPU
                      it lands on what backward held, which glibc keeps resident)
            load      (CPU) the loaded weights alone (the checkpoint hash reads them in place)
  pre-inf.  prefix weights in the cache dtype + one micro-batch's inference working set;
            on CPU also one shard of outputs (list + concatenation), its input and, pipelined,
            the next shard's input and the previous shard's encode

Derived (arithmetic): weights, gradients, optimizer state, saved activations — per-layer
element counts of what autograd keeps for the HF layer implementations with a fused SDPA kernel
(no S x S matrix), checked against `saved_tensors_hooks` in tests/test_plan.py. Measured
(CPU only, see the constants below): fixed runtime overhead and the host-side I/O and
allocator factors. Assumed (GPU): the CUDA context reserve; no GPU was available to validate.
FLOPs per step (for the cost estimate in preinfer.run.plan_report) live here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from preinfer.model.partition import partition_layers
from preinfer.model.shape import ModelShape
from preinfer.runtime.device import compute_dtype
from preinfer.schedule.cache_identity import PreinferConfig
from preinfer.schedule.rotation import VisitBudget
from preinfer.train.config import TrainConfig
from preinfer.train.suffix import adapter_linear_dims
from storage.config import CacheConfig
from storage.dataset import buffer_rows, reads_whole
from storage.layout import rows_per_shard
from storage.values import stored_dtype

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
# per-tensor loop, x all active params on GPU's foreach path). Adam and AdamW run the fused
# kernel (preinfer.train.step.build_optimizer): no temporaries on CPU (a 46M-parameter step grew
# the peak by 0 MB, against 2x its largest tensor in the per-tensor loop); the GPU row is
# foreach's, kept until measured there.
OPT_STATE = {"sgd": 4, "adam": 8, "adamw": 8}
OPT_TEMP = {"cpu": {"sgd": 1, "adam": 0, "adamw": 0}, "gpu": {"sgd": 1, "adam": 1, "adamw": 1}}
# CPU-only constants, measured (not derived) by `python -m bench.plan_accuracy --calibrate` on
# a minimal model and configs/llama-small.yaml, never on the configs the bench validates; how
# each was set and when: docs/planner.md ("Calibration history"). Re-measure when storage/, the
# trainer or the libraries change.
# RUNTIME: fixed peak-RSS growth of each code path. CPU_ALLOC: RSS per live byte of activations
# (glibc keeps the forward's freed temporaries in its heap). CPU_INFER: the same for the bf16
# inference working set. HOST_IO: (fixed bytes, RSS per byte) of the data a reader or writer
# holds: decode, copies, and the codec threads' malloc arenas. On a GPU machine those buffers
# are host RAM, not card memory; the GPU runtime row (CUDA context + cuBLAS workspace) is an
# assumption, not measured here.
RUNTIME = {
    ("cpu", "trainer"): 59 * MiB,
    ("cpu", "trainer-cache"): 55 * MiB,
    ("cpu", "preinfer"): 47 * MiB,
    # a refresh reads no token store: a build's token reads alone leave ~45 MiB resident
    # (Arrow/Parquet buffers and pools; llama-small, 8 MiB shards, fresh process, 2 arenas);
    # preinfer, preinfer-refresh and CPU_INFER re-fitted 2026-12-02 (docs/planner.md)
    ("cpu", "preinfer-refresh"): 10 * MiB,
    # while weights load, before any compute (no thread pools, arenas or codec threads yet)
    ("cpu", "load"): 4 * MiB,
    ("gpu", "trainer"): 768 * MiB,
    ("gpu", "trainer-cache"): 768 * MiB,
    ("gpu", "preinfer"): 768 * MiB,
    ("gpu", "preinfer-refresh"): 768 * MiB,
}
CPU_ALLOC = 1.42
CPU_INFER = 1.52
HOST_IO = {
    "token_read": (0, 6.5),  # one token-store shard (data.shard_rows x (S+1) int32), Parquet
    # the reader's stored rows (shuffle buffer + the shard being read): 1.0 by hand — the
    # --calibrate fits gave (29 MiB, -0.09) and, with the fused loss, (12 MiB, 0.58): a buffer
    # that is written whole costs at least its bytes
    "cache_read": (0, 1.0),
    "cache_write": (35 * MiB, 0.48),  # one cache shard (stored dtype): encode, checksum, compress
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
    compute_bytes: int = 0
    """Bytes per value the prefix forward computes in (preinfer.compute_dtype as resolved for
    the target; 0: the cache dtype's float width)."""
    shard_rows: int = 1
    """Rows per cache shard the pre-inference worker computes and encodes at once."""
    token_rows: int = 4096
    """Rows of the token-store shard the token reader decodes at once (data.shard_rows)."""
    micro_batch: int = 16
    loss_chunk: int = 256
    """Tokens per chunk of the fused LM head + loss (train.loss_chunk); 0 = the plain loss."""
    pipelined: bool = True
    """A pre-inference worker call holds several shards (next input read, last one written)."""
    suffix_rank: int = 0
    """train.suffix_rank: LoRA adapters on the layers after the active block (bcd modes)."""
    suffix_modules: str = "all"
    """train.suffix_modules: which linears of those layers get one (all, attn, mlp)."""
    freeze_embed: bool = False
    """train.freeze=[embed]: the embedding (and a tied head matrix) has no grad or state."""
    prefix_last: bool = False
    """train.prefix_adapters=last with train.order=ascending: block M-1's visit (the round's
    last) runs from tokens with adapters on every earlier layer too. (descending ends on block
    0: nothing changes; random: not modelled, each visit is planned from its cache.)"""


# bytes per logit of one chunk of the fused loss (preinfer.model.loss): the fp32 logits that become
# the softmax and d loss / d logits in place, and logsumexp's fp32 temporary
CHUNK_LOGIT = 8


def _loss_terms(sh, p: Setup, T: int, matrix_tr: bool) -> tuple[int, int]:
    """(bytes at the loss's own peak, bytes it keeps alive through backward) for T tokens."""
    pr = _bytes(p)
    if not p.loss_chunk:
        return T * sh.vocab * pr.logit, T * sh.vocab * pr.keep
    # d loss / d x (T, H) in the head input's dtype (fp32: LayerNorm/RMSNorm outputs fp32 under
    # autocast) and d loss / d W (V, H) fp32 when the head matrix trains, made in forward
    keep = 4 * T * sh.hidden + (4 * sh.head_matrix if matrix_tr else 0)
    peak = min(p.loss_chunk, T) * sh.vocab * CHUNK_LOGIT + keep
    return peak + (4 * sh.head_matrix if matrix_tr else 0), keep  # + the chunk's dW matmul


def _worst(phases: dict[str, dict], keys: tuple[str, ...], runtime: float) -> tuple[str, dict]:
    """(name, components) of the phase holding the most: each phase's parts plus its runtime
    (its own, as loading has, else `runtime`), components in `keys` order, then runtime."""
    held = {n: {"runtime": runtime, **c} for n, c in phases.items()}
    name, comp = max(held.items(), key=lambda kv: sum(kv[1].values()))
    return name, {k: comp.get(k, 0) for k in (*keys, "runtime")}


def _bytes(p: Setup) -> Precision:
    return PRECISIONS[p.precision]


def optimizer_state_bytes(p: Setup) -> int:
    """Bytes per trained parameter of the optimizer's own state (moments; SGD's momentum
    buffer, none without momentum): in memory while a block trains, on disk when kept."""
    return OPT_STATE[p.optimizer] if (p.optimizer != "sgd" or p.momentum) else 0


def _sweep(sh, layers, trainable, head_norm_tr, matrix_tr, embed_tr, p: Setup):
    """Peak of saved activations + gradients through one forward/backward, and its split.

    Backward walks from the loss down: the loss peak holds every saved activation plus the
    loss's own peak (_loss_terms); then each layer's activations are released as its parameter
    gradients appear, while the loss's kept tensors stay."""
    pr, T = _bytes(p), p.batch * p.seq
    loss_peak, loss_keep = _loss_terms(sh, p, T, matrix_tr)
    matrix_saved = matrix_tr and not p.loss_chunk  # the fused loss saves no head input
    cast = lambda n: pr.cast * n  # noqa: E731  (autocast's bf16 weight copies, saved for bwd)
    acts = []
    for j in layers:
        a = T * layer_act(sh, trainable[j]) * pr.act + cast(sh.layers[j])
        acts.append((a, T * sh.hidden * pr.act + cast(sh.layers[j])) if p.act_recompute else (a, a))
    grads = [pr.grad * sh.layers[j] if trainable[j] else 0 for j in layers]
    a_head = T * head_act(sh, head_norm_tr, matrix_saved) * pr.act + cast(sh.head_matrix)
    g_head = pr.grad * ((sh.head if head_norm_tr else 0) + (sh.head_matrix if matrix_tr else 0))
    stored = sum(s for _, s in acts)
    points = [(stored + a_head + loss_peak, stored + a_head + loss_peak, 0)]
    live_g = g_head
    ws = T * (2 * sh.hidden + 2 * sh.inter) * pr.act  # gradients flowing through one layer
    for i in range(len(layers) - 1, -1, -1):
        full, kept = acts[i]
        below = sum(s for _, s in acts[:i])
        live_g += grads[i]
        act = below + full + ws + loss_keep
        points.append((act + live_g, act, live_g))
    if embed_tr:  # the embedding gradient (+ a dense V x H scatter buffer when tied)
        e = pr.grad * (sh.embed - (sh.head_matrix if sh.tied else 0))
        extra = pr.grad * sh.head_matrix if sh.tied else 0
        points.append((live_g + e + extra + loss_keep, loss_keep, live_g + e + extra))
    return max(points)


def trainer_memory(sh: ModelShape, part, mode: str, block: int, p: Setup) -> dict:
    """Peak bytes per card of one visit (mode full or bcd block K), with its breakdown and the
    raw terms (`basis`) the calibration divides by."""
    pr, M, cpu = _bytes(p), part.num_blocks, p.target == "cpu"
    whole = bool(p.prefix_last and p.suffix_rank) and mode != "full" and block == M - 1
    first = 0 if mode == "full" or block == 0 or whole else part.blocks[block][0]
    # bcd-recompute loads the prefix too and reruns it without grad (nothing saved)
    loaded_blocks = range(M) if first == 0 or mode == "bcd-recompute" else range(block, M)
    active = range(M) if mode == "full" else [block]
    layers = list(range(first, part.num_layers))
    trainable = {j: part.block_of_layer(j) in active for j in layers}
    embed_tr, head_tr = 0 in active and not p.freeze_embed, (M - 1) in active
    matrix_tr = (head_tr and not sh.tied) or (sh.tied and embed_tr)
    n_loaded = sum(part.block_params[b] for b in loaded_blocks)
    if loaded_blocks[0] > 0 and sh.tied:
        n_loaded += sh.head_matrix  # the tied matrix, read from block 0's file for the head
    n_active = sum(part.block_params[b] for b in active)
    n_active -= sh.embed if 0 in active and p.freeze_embed else 0
    W, G = pr.weight * n_loaded, pr.grad * n_active
    opt = (optimizer_state_bytes(p) + pr.master) * n_active
    _, act, grads = _sweep(sh, layers, trainable, head_tr, matrix_tr, embed_tr, p)
    # suffix adapters (fp32 A, B + grads + optimizer state) on every layer after block K (and
    # before it, `whole`); each adapted linear saves its input (for dA) and A x (for dB):
    # (in + r) per token
    n_sfx = act_sfx = 0
    if p.suffix_rank and mode != "full" and (block < M - 1 or whole):
        dims = adapter_linear_dims(sh.arch, sh.hidden, sh.inter, sh.kv_dim, p.suffix_modules)
        n_layers = part.num_layers - part.blocks[block][1] + (part.blocks[block][0] if whole else 0)
        n_sfx = n_layers * p.suffix_rank * sum(i + o for i, o in dims)
        act_sfx = n_layers * p.batch * p.seq * sum(i + p.suffix_rank for i, _ in dims) * pr.act
    W, G = W + 4 * n_sfx, G + 4 * n_sfx
    opt += optimizer_state_bytes(p) * n_sfx
    act, grads = act + act_sfx, grads + 4 * n_sfx
    T = p.batch * p.seq  # eval: logits (a chunk's when fused) + log-softmax, nothing saved
    ev = 2 * (min(p.loss_chunk, T) if p.loss_chunk else T) * sh.vocab * 4
    from_cache = mode == "bcd" and block > 0 and not whole
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
    backward = dict(weights=W, optimizer=opt, activations=alloc * act, grads=grads, reader=reader)
    phases = {
        "backward": backward,
        "step": dict(weights=W, optimizer=opt + temp, grads=G + (G if p.world > 1 else 0),
                     reader=reader),
        # CPU: glibc keeps backward's freed activations resident (its heap is not trimmed
        # under live blocks): the val reader lands on top of them, the eval forward reuses them
        "eval": {**backward, "reader": reader + val} if cpu else
                dict(weights=W, optimizer=opt, grads=G, reader=reader + val, activations=ev),
    }  # fmt: skip
    if cpu:
        phases["load"] = dict(weights=W, runtime=RUNTIME[("cpu", "load")])
    run = RUNTIME[("cpu" if cpu else "gpu", "trainer-cache" if from_cache else "trainer")]
    name, comp = _worst(phases, ("weights", "grads", "optimizer", "activations", "reader"), run)
    basis = {"static": W + opt, "act": act, "grads": grads, "cache_buffer": buf[0],
             "val_buffer": buf[1], "token_shard": tok, "load": W}  # fmt: skip
    return {"stage": "full" if mode == "full" else f"{mode} block {block}", "mode": mode,
            "block": block, "phase": name, "peak": sum(comp.values()), "components": comp,
            "loaded_params": n_loaded, "active_params": n_active, "suffix_params": n_sfx,
            "loaded_blocks": list(loaded_blocks), "basis": basis}  # fmt: skip


def preinfer_memory(sh: ModelShape, part, block: int, p: Setup, *, refresh: bool = False) -> dict:
    """Peak bytes of one pre-inference worker producing boundary `block` (build: prefix blocks
    0..K-1 from tokens; refresh: block K-1 alone from the boundary K-1 cache).

    A worker call pipelines its shards (pipelines/cache_build.py): while shard j computes, shard
    j+1's input is read and shard j-1 is encoded and written (p.pipelined); else one at a time."""
    cpu = p.target == "cpu"
    blocks = [block - 1] if refresh else list(range(block))
    n = sum(part.block_params[b] for b in blocks)
    cb = p.cache_dtype_bytes if p.cache_dtype_bytes in (2, 4) else 4  # int8/fp8: fp32 compute
    # a bf16 cache computed in fp32 where bf16 is slow (a CPU without AMX): fp32 weights and work
    wb = p.compute_bytes or cb
    work = p.micro_batch * p.seq * infer_act(sh) * wb
    shard = p.shard_rows * p.seq * sh.hidden * cb
    phases = {"compute": dict(weights=wb * n, activations=work)}
    if cpu:  # outputs (list, then concatenated), the encode and the inputs: host RAM
        # a refresh's input: the source shard's stored values (n, S, H), a view in the cache
        # dtype; a build's: token ids (n, S) int64. Pipelined: the next shard's input too.
        one_in = shard if refresh else p.shard_rows * p.seq * 8
        inputs = (2 if p.pipelined else 1) * one_in
        write = shard + host_io("cache_write", shard)  # the shard being encoded and written
        big = sh.max_tensor if 0 in blocks else sh.max_layer_tensor
        phases = {
            "compute": dict(weights=wb * n, activations=CPU_INFER * work,
                            shard=2 * shard + inputs + (write if p.pipelined else 0)),
            "encode": dict(weights=wb * n, shard=write + inputs),
        }  # fmt: skip
    if cpu:  # fp32 from the file, cast tensor by tensor: + the cast copy of the largest one
        cast = 0 if wb == 4 else wb * big
        phases["load"] = dict(weights=4 * n + cast, runtime=RUNTIME[("cpu", "load")])
    run = RUNTIME[("cpu" if cpu else "gpu", "preinfer-refresh" if refresh else "preinfer")]
    name, comp = _worst(phases, ("weights", "activations", "shard"), run)
    return {"stage": f"pre-inference {'refresh' if refresh else 'build'} -> boundary {block}",
            "block": block, "refresh": refresh, "phase": name, "peak": sum(comp.values()),
            "components": comp, "prefix_params": n,
            "basis": {"weights": wb * n, "work": work, "shard": shard, "inputs": inputs if cpu else 0,
                      "pipelined": p.pipelined,
                      "load": phases["load"]["weights"] if cpu else 0}}  # fmt: skip


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


def smallest_fitting_m(sh: ModelShape, p: Setup, card_bytes: float) -> dict | None:
    """Smallest M whose worst BCD block fits `card_bytes` (block 0 holds every weight)."""

    L = len(sh.layers)

    def worst(m):
        part = partition_layers(list(sh.layers), sh.embed, sh.head, m)
        r = max((trainer_memory(sh, part, "bcd", k, p) for k in range(m)), key=lambda r: r["peak"])
        return {"M": m, "peak": r["peak"], "worst_stage": r["stage"],
                "blocks": [list(b) for b in part.blocks]}  # fmt: skip

    if worst(L)["peak"] > card_bytes:  # one layer per block does not fit: no M will
        return None
    return next(w for m in range(1, L + 1) if (w := worst(m))["peak"] <= card_bytes)


def setup_for(
    sh: ModelShape, train: TrainConfig, cache: CacheConfig, preinfer: PreinferConfig, *,
    target: str, seq: int, token_rows: int, run_precision: str = "auto",
    budget: VisitBudget | None = None, batch: int | None = None, cards: int = 1,
    precision: str | None = None, optimizer: str | None = None, act_recompute: bool = False,
    pipelined: bool = True,
) -> Setup:  # fmt: skip
    """The per-card Setup of these settings: batch (train.batch_size) split over `cards`
    data-parallel replicas, precision from run.precision `run_precision` (auto: amp-bf16 on GPU,
    fp32 on CPU), cache reader/worker buffers from cache.shard_mb and the round's rows
    (`budget`; None, N unknown: assume at least one full shard). seq: S; token_rows:
    data.shard_rows. pipelined: pre-inference calls get several shards each
    (pipelines.cache_build.shards_per_task > 1; True, the larger estimate, when the shard count
    is not known)."""

    S = seq
    B = batch or train.batch_size
    b = max(1, math.ceil(B / cards))
    if precision is None:
        rp = run_precision
        precision = "fp32" if rp == "fp32" or (target == "cpu" and rp == "auto") else "amp-bf16"
    rps = rows_per_shard(S, sh.hidden, cache.dtype, cache.shard_mb)
    n_train, n_val = (None, None) if budget is None else (budget.n_train, budget.n_val)
    n_tr = None if budget is None else budget.rows
    tr_rows = rps if n_tr is None else min(rps, n_tr)
    # the trainer's shuffle buffer, as the reader sizes it for a visit's window of the round's
    # rows (N unknown: the full budget); a window that fits it is read whole, on every rank
    row_bytes = S * sh.hidden * stored_dtype(cache.dtype).itemsize
    mb = train.shuffle_buffer_mb
    win = None if budget is None else budget.visit_rows
    buf_rows = buffer_rows(
        row_bytes, rps, b, None if win is None else math.ceil(win / cards), None, mb
    )  # fmt: skip
    if win is not None and reads_whole(win, row_bytes, mb):
        buf_rows = win
    val_rows = rps if n_val is None else min(rps, n_val)
    device = "cuda" if target == "gpu" else "cpu"  # a CPU target: this machine's capability
    prefix = compute_dtype(preinfer.compute_dtype, cache.dtype, device)
    opt = optimizer or train.optimizer
    return Setup(precision=precision, optimizer=opt, momentum=train.momentum != 0,
                 batch=b, seq=S, target=target, act_recompute=act_recompute, world=cards,
                 reader_rows=buf_rows, val_rows=max(val_rows, min(B, n_val or B)),
                 cache_dtype_bytes=stored_dtype(cache.dtype).itemsize, shard_rows=tr_rows,
                 compute_bytes=4 if prefix.compute == "fp32" else 2,
                 token_rows=min(token_rows, n_train or token_rows),
                 micro_batch=preinfer.micro_batch,
                 loss_chunk=train.loss_chunk, pipelined=pipelined,
                 suffix_rank=train.suffix_rank,
                 suffix_modules=train.suffix_modules,
                 freeze_embed="embed" in train.freeze,
                 prefix_last=train.last_block_from_tokens)  # fmt: skip
