"""Value types of the activation cache: what each logical cache dtype stores, and the value
encode/decode between hidden states and stored arrays.

Logical dtype (CacheConfig.dtype) -> what Zarr stores:
    fp32      float32   exact
    fp16      float16   exact for fp16 input; fp32 input is rounded (|x| > 65504 is an error)
    bf16      uint16    the raw bf16 bits (Zarr v3 has no bfloat16); exact for bf16 input
    int8      int8      lossy: q = round(x / s), s = absmax(token) / 127, one s per (sample, pos)
    fp8_e4m3  uint8     lossy: bits of fp8_e4m3fn(clamp(x / s, ±448)), s = absmax(token) / 448
Lossy types store the scale s as float32 [N, S] in scale.zarr; decode is q * s. A token whose
values are all zero gets s = 0 and decodes to exact zeros (no 0/0).
"""

from __future__ import annotations

import numpy as np
import torch

from storage.config import LOSSY_DTYPES

STORED_NP = {
    "fp32": np.dtype("float32"),
    "fp16": np.dtype("float16"),
    "bf16": np.dtype("uint16"),
    "int8": np.dtype("int8"),
    "fp8_e4m3": np.dtype("uint8"),
}
# torch dtype of the decoded logical values before the caller's cast (lossy -> float32).
LOGICAL_TORCH = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.float32,
    "fp8_e4m3": torch.float32,
}
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class CodecError(ValueError):
    """Values cannot be stored in the requested format (message says why and what to do)."""


def is_lossy(dtype: str) -> bool:
    return dtype in LOSSY_DTYPES


def stored_dtype(dtype: str) -> np.dtype:
    if dtype not in STORED_NP:
        raise CodecError(f"unknown cache dtype {dtype!r}; choose one of {', '.join(STORED_NP)}")
    return STORED_NP[dtype]


def _as_float_tensor(values) -> torch.Tensor:
    if isinstance(values, np.ndarray):
        if values.dtype not in (np.float32, np.float16):
            raise CodecError(
                f"hidden states must be float32/float16 (numpy) or a float torch tensor, got "
                f"numpy {values.dtype}; pass a torch bfloat16 tensor for bf16 values"
            )
        values = torch.from_numpy(np.ascontiguousarray(values))
    if not isinstance(values, torch.Tensor):
        raise CodecError(f"hidden states must be a torch tensor or numpy array, got {type(values)}")
    if values.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise CodecError(f"hidden states must be fp32/fp16/bf16, got {values.dtype}")
    return values.detach().cpu().contiguous()


_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}  # exponent bits all set = inf/NaN


def _count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN/inf values; on raw bits for 16-bit floats (torch.isfinite on bf16 is slow)."""
    if x.dtype in _EXP_MASK:
        m = _EXP_MASK[x.dtype]
        return int(np.count_nonzero((x.view(torch.int16).numpy() & m) == m))
    a = x.numpy()
    return (
        0 if np.isfinite(a.max(initial=0.0) - a.min(initial=0.0)) else int((~np.isfinite(a)).sum())
    )


def _refuse_nonfinite(x: torch.Tensor) -> None:
    bad = _count_nonfinite(x)
    if bad:
        raise CodecError(
            f"{bad} of {x.numel()} hidden values are NaN/inf; the prefix model diverged or "
            "overflowed; fix the model (or its dtype) before caching"
        )


def encode(
    values, dtype: str, *, check_finite: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """values [n, S, H] (fp32/fp16/bf16) -> (stored [n, S, H], scale [n, S] float32 | None).

    Raises CodecError on NaN/inf input (check_finite=False skips that pass: the caller checks
    the decoded values, e.g. with shard_stats) or on values the format cannot hold (fp16
    overflow).
    """
    x = _as_float_tensor(values)
    if check_finite:
        _refuse_nonfinite(x)
    if dtype == "fp32":
        return x.float().numpy(), None
    if dtype in ("fp16", "bf16"):
        y = x.to(LOGICAL_TORCH[dtype])
        if dtype == "fp16" and x.dtype != torch.float16 and not bool(torch.isfinite(y).all()):
            _refuse_nonfinite(x)
            raise CodecError(
                f"hidden values up to {float(x.abs().max()):.4g} overflow fp16 (max 65504); "
                "use cache.dtype=bf16 or fp32"
            )
        return (y.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else y.numpy()), None
    if dtype not in LOSSY_DTYPES:
        raise CodecError(f"unknown cache dtype {dtype!r}; choose one of {', '.join(STORED_NP)}")
    x = x.float()
    qmax = INT8_MAX if dtype == "int8" else FP8_MAX
    scale = x.abs().amax(dim=-1) / qmax  # [n, S] float32; 0 for an all-zero token
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    y = (x / safe).clamp_(-qmax, qmax)  # clamp BEFORE the cast: no overflow, no NaN
    if dtype == "int8":
        q = torch.round(y).to(torch.int8).numpy()
    else:
        q = y.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return q, scale.numpy()


def decode(stored: np.ndarray, scale: np.ndarray | None, dtype: str, out_dtype=torch.float32):
    """Stored values (+ scale for lossy) -> torch tensor in `out_dtype` (None: logical dtype)."""
    t = torch.from_numpy(np.ascontiguousarray(stored))
    if dtype == "bf16":
        t = t.view(torch.bfloat16)  # uint16 bits -> bf16, no copy
    elif dtype in LOSSY_DTYPES:
        if scale is None:
            raise CodecError(f"cache dtype {dtype} needs its scale array to decode")
        if dtype == "fp8_e4m3":
            t = t.view(torch.float8_e4m3fn)
        t = t.float() * torch.from_numpy(np.ascontiguousarray(scale)).unsqueeze(-1)
    return t if out_dtype is None else t.to(out_dtype)
