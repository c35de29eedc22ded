"""Content fingerprints, chained in the manner of HF `datasets`.

A fingerprint is a hex sha256 of canonical JSON of its inputs; inputs that are themselves
fingerprints chain. Tensors are hashed by content (dtype, shape, bytes), never by identity.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

# Bump when the cache layout or the meaning of a stored value changes: old caches then get a
# different fingerprint and are rebuilt instead of misread.
CACHE_FORMAT_VERSION = 1
SHORT = 16  # hex chars used in directory names


def canonical(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, list | tuple):
        return [canonical(v) for v in obj]
    if isinstance(obj, float) and obj.is_integer():
        return obj  # keep 1.0 vs 1 distinct as JSON renders them
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def hash_obj(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys, no whitespace)."""
    blob = json.dumps(canonical(obj), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def chain(kind: str, **parts: Any) -> str:
    """Fingerprint of a named artefact from its named inputs."""
    return hash_obj({"kind": kind, **parts})


def update_tensor(h: Any, name: str, t: torch.Tensor) -> None:
    t = t.detach().contiguous().cpu()
    h.update(f"{name}|{str(t.dtype)}|{tuple(t.shape)}|".encode())
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    h.update(t.numpy().reshape(-1).view("uint8"))  # the tensor's own bytes, not a copy


def tensors_hash(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """Content hash of named tensors, independent of dict order and object identity."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    h = hashlib.sha256()
    for name, t in sorted(items, key=lambda kv: kv[0]):
        update_tensor(h, name, t)
    return h.hexdigest()


def file_hash(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cache_fingerprint(
    *,
    tokens: str,
    split: str,
    prefix: str,
    boundary: int,
    model: Mapping[str, Any],
    dtype: str,
    codec: Mapping[str, Any],
    sampling: Mapping[str, Any] | None = None,
    compute: str | None = None,
) -> str:
    """Fingerprint of the boundary cache: everything that decides its bytes.

    tokens: token-set fingerprint; prefix: content hash of blocks 0..boundary-1 (from the
    checkpoint index); model: the model config (architecture); codec: codec settings;
    sampling: which subset of samples (None = all); compute: the dtype the prefix computed in,
    None where it is the stored dtype's own (then it is not hashed: older caches keep theirs).
    """
    return chain(
        "cache",
        tokens=tokens,
        split=split,
        prefix=prefix,
        boundary=boundary,
        model=model,
        dtype=dtype,
        codec=codec,
        sampling=sampling or {"fraction": 1.0},
        format_version=CACHE_FORMAT_VERSION,
        **({"compute_dtype": compute} if compute is not None else {}),
    )[: 2 * SHORT]
