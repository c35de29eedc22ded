"""Device and precision choice: training's autocast (`training_precision`) and pre-inference's
compute dtype (`compute_dtype`), both by one rule: bf16 where the device computes it fast
(CUDA; a CPU with AMX-BF16 tiles, `cpu_amx_bf16`), fp32 elsewhere. A CPU with AVX512-BF16 but
no AMX has bf16 instructions, yet ran both slower in bf16 than in fp32 (docs/training.md)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from core.config import ConfigError

# the dtype a stored cache dtype was computed in before compute_dtype existed (the fingerprint's
# reference: a cache computed this way keeps its fingerprint; any other compute dtype enters it)
NATIVE_COMPUTE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}  # int8 / fp8: fp32
ROUNDED_STORE = ("bf16", "fp16")  # float stores that fp32 compute rounds to at block boundaries


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "run.device=cuda but no CUDA device is visible; use run.device=auto or cpu"
        )
    return torch.device(device)


def training_precision(device: torch.device, precision: str = "auto") -> tuple[str, str]:
    """Resolve run.precision for training on `device`: ("bf16" | "fp32", why). auto = bf16
    autocast on CUDA and on CPUs with AMX-BF16 tiles; fp32 elsewhere. A CPU with AVX512-BF16
    but no AMX computes bf16 natively, yet a visit trained no faster under bf16 autocast than
    in fp32 there (docs/training.md, bench/trainer_step.py --precision: 0.98x and 0.84x), and an AVX2 CPU
    emulates bf16 matmuls ~50x slower than fp32."""
    if precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"run.precision must be auto, fp32 or bf16, got {precision!r}")
    if precision != "auto":
        return precision, f"run.precision={precision}"
    if device.type == "cuda":
        return "bf16", "run.precision=auto: bf16 autocast on CUDA"
    if device.type != "cpu":
        return "fp32", f"run.precision=auto: fp32 on {device.type}"
    native, cap = cpu_native_bf16()
    if cpu_amx_bf16():
        return "bf16", f"run.precision=auto: CPU capability {cap}, AMX-BF16: bf16 autocast"
    if native:
        return "fp32", (
            f"run.precision=auto: CPU capability {cap}, bf16 without AMX (bf16 autocast "
            "trains no faster there): fp32"
        )
    return "fp32", f"run.precision=auto: CPU capability {cap}, no native bf16 matmul: fp32"


def autocast(device: torch.device, precision: str = "auto"):
    """bf16 autocast where training_precision says bf16; a no-op context for fp32."""
    if device.type in ("cuda", "cpu") and training_precision(device, precision)[0] == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def torch_dtype(name: str) -> torch.dtype:
    """Dtype name -> torch dtype (lossy cache dtypes: fp32, the dtype they quantize from)."""
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(
        name, torch.float32
    )


def pin_threads(threads: int | None = None) -> int:
    """Fix torch's intra-op threads for this process (None: the count it has) and return it.
    torch.set_num_threads also fixes MKL's thread count and turns MKL's dynamic choice off:
    until it is called, an MKL product may run on fewer threads than asked, and a CPU forward
    or step can differ in its last bits from one process to the next (docs/failures.md)."""
    n = threads or torch.get_num_threads()
    torch.set_num_threads(n)
    return n


@functools.cache
def cpu_native_bf16() -> tuple[bool, str]:
    """(whether this CPU has bf16 matmul instructions, its name for them). x86: AVX512-BF16 or
    AMX-BF16; ARM: bf16 (NEON) or SVE-bf16. Without them a bf16 matmul is emulated: ~50x
    slower than fp32 on an AVX2 CPU."""
    caps = torch.cpu.get_capabilities()
    have = [k for k in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16") if caps.get(k) is True]
    cap = torch.backends.cpu.get_cpu_capability()
    return bool(have), f"{cap}{' + ' + ', '.join(have) if have else ''}"


@functools.cache
def cpu_amx_bf16() -> bool:
    """Whether this CPU has AMX-BF16 tiles (Sapphire Rapids and later): where bf16 training on
    the CPU pays."""
    return torch.cpu.get_capabilities().get("amx_bf16") is True


@dataclass(frozen=True)
class ComputeChoice:
    """The dtype a prefix forward computes in, and the stored dtype it rounds to at each block
    boundary (None: no rounding, the compute dtype is the stored one or the store is lossy)."""

    compute: str
    round_to: str | None
    reason: str


def compute_dtype(requested: str, cache_dtype: str, device: str = "auto") -> ComputeChoice:
    """Resolve preinfer.compute_dtype for a cache of `cache_dtype` on run.device `device`.

    auto: the stored float dtype where the device computes in it fast (CUDA; for bf16 a CPU
    with AMX-BF16), else fp32 with each block's output rounded to the stored dtype, so that a
    refresh (which starts from the stored boundary) equals a build bit for bit. On a CPU with
    AVX512-BF16 but no AMX the fp32 forward ran 1.47x (H=576) and 1.48x (H=1024) faster than
    bf16's (bench/preinfer_throughput.py --arms dtype).
    """
    native = NATIVE_COMPUTE.get(cache_dtype, "fp32")
    if requested not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"preinfer.compute_dtype must be auto, fp32 or bf16, got {requested!r}")
    kind = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if requested != "auto":
        name, reason = requested, f"preinfer.compute_dtype={requested}"
    elif native == "fp32":
        name, reason = "fp32", f"cache.dtype={cache_dtype} computes in fp32"
    elif kind == "cuda":
        name, reason = native, f"{native} on CUDA"
    else:
        has, cap = cpu_native_bf16()
        if native == "bf16" and cpu_amx_bf16():
            name, reason = "bf16", f"CPU capability {cap}: AMX-BF16, native bf16"
        elif native == "bf16" and has:
            name, reason = (
                "fp32",
                (
                    f"CPU capability {cap}: bf16 without AMX (a bf16 forward runs slower than fp32 "
                    "there), so fp32 rounded to bf16 at each block boundary"
                ),
            )
        else:
            name, reason = (
                "fp32",
                (
                    f"CPU capability {cap}: no native {native} matmul (emulated ~50x slower than "
                    f"fp32), so fp32 rounded to {native} at each block boundary"
                ),
            )
    round_to = cache_dtype if cache_dtype in ROUNDED_STORE and name != cache_dtype else None
    return ComputeChoice(compute=name, round_to=round_to, reason=reason)


def compute_dtype_key(choice: ComputeChoice, cache_dtype: str) -> str | None:
    """The compute dtype as a fingerprint field: None where it is the stored dtype's own
    (caches written before compute_dtype existed keep their fingerprint)."""
    return None if choice.compute == NATIVE_COMPUTE.get(cache_dtype, "fp32") else choice.compute
