"""Device and precision choice: CUDA + bf16 autocast when a GPU is present, fp32 on CPU."""

from __future__ import annotations

import contextlib

import torch

from preinfer.confload import ConfigError


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "run.device=cuda but no CUDA device is visible; use run.device=auto or cpu"
        )
    return torch.device(device)


def autocast(device: torch.device, precision: str = "auto"):
    """bf16 autocast on CUDA (precision auto/bf16); a no-op context on CPU or for fp32."""
    if device.type == "cuda" and precision in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def torch_dtype(name: str) -> torch.dtype:
    """Cache dtype name -> the torch dtype the prefix computes and stores in."""
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(
        name, torch.float32
    )
