"""What a cache was made from, as a reuser must match it: the manifest's `identity`, and the
check every reader runs against what its caller expects (`expect=`).

A cache written by `preinfer cache extract` records its identity in manifest.json (and in
build.json from its creation): the model, the tokenizer, the layer, how values are stored. A
BCD boundary cache has no `identity` field; what its header and meta say stands in for it
(`cache_identity`). A reader given `expect` (a dict or an `ExtractSpec`) refuses a cache whose
identity differs in any expected field with ONE line (`IdentityMismatch`) naming each field,
the expected and the found value, and what to do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from storage.layout import CacheError, FingerprintMismatch

# The meaning of a layer id (docs/cache_format.md, "Layer semantics"); bump the version if
# it ever changes, so a cache of the old meaning never matches an expectation of the new.
LAYER_SEMANTICS = (
    "v1: layer L = the hidden state entering layer L (= the output of layer L-1); "
    "L=0: the embedding output; L=num_layers: the last layer's output, before the final norm"
)

# field -> (JSON types it may hold, what it is); the docs table mirrors this
FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "kind": ((str,), "layers (preinfer cache extract) or boundary (a BCD boundary cache)"),
    "model": ((str,), "content hash of the checkpoint: every block's tensors, chained"),
    "model_source": ((str,), "where its weights came from: the HF checkpoint dir, or random"),
    "arch": ((str,), "the model family: gpt2, llama, bert, sequential"),
    "num_layers": ((int,), "the model's layers"),
    "tokenizer": ((str,), "sha256 of the token store's tokenizer.json"),
    "tokens": ((str,), "the token store's fingerprint (corpus, tokenizer, seq_len, split rule)"),
    "chat_template": ((str, type(None)), "sha256 of the chat template the rows were rendered with"),
    "split": ((str,), "train or val"),
    "rows": ((int,), "token-store rows held (the first ones of the split)"),
    "layer": ((int,), "the layer whose input the cache holds (LAYER_SEMANTICS)"),
    "boundary": ((int,), "the BCD boundary (block) whose input a boundary cache holds"),
    "layer_semantics": ((str,), "what a layer id means (LAYER_SEMANTICS)"),
    "compute_dtype": ((str,), "the dtype the forward computed in"),
    "dtype": ((str,), "the stored value type: fp32, fp16, bf16, int8, fp8_e4m3"),
    "codec": ((str,), "the compression of each sample chunk: none, zstd, blosc-zstd"),
    "seq_len": ((int,), "positions per row"),
    "hidden_size": ((int,), "values per position"),
    "format_version": ((int,), "the cache format version"),
}

# what to do about a differing field (the first differing field's hint ends the line)
HINTS = {
    "layer": "open the cache of that layer (`preinfer cache ls` shows each cache's layer) or "
    "extract it: `preinfer cache extract --layers {want}`",
    "model": "the cache was made from other weights (another checkpoint, or this one trained "
    "since): extract it again from yours (`preinfer cache extract`)",
    "format_version": "the cache was written by another preinfer version: extract it again",
}
DEFAULT_HINT = (
    "open the cache made for what you expect (`preinfer cache ls` lists caches, `preinfer cache "
    "inspect FP` shows one's identity) or make it with `preinfer cache extract`"
)


class IdentityMismatch(FingerprintMismatch):
    """The cache was made from other inputs (model, tokenizer, layer, dtype...) than expected."""


@dataclass(kw_only=True, frozen=True)
class ExtractSpec:
    """The identity a reader expects of a cache; a field left None is not checked.

    open_cache(root, fp, expect=ExtractSpec(layer=6, model=model_hash, dtype="bf16"))
    """

    model: str | None = None
    """Content hash of the checkpoint (pipelines.extract.model_hash of it)."""
    model_source: str | None = None
    """The HF checkpoint directory the weights were initialised from, or random."""
    tokenizer: str | None = None
    """sha256 of the tokenizer.json the token ids come from."""
    tokens: str | None = None
    """The token store's fingerprint."""
    chat_template: str | None = None
    """sha256 of the chat template (only checked when given)."""
    split: str | None = None
    """train or val."""
    layer: int | None = None
    """The layer whose input the cache holds."""
    dtype: str | None = None
    """Stored value type."""
    codec: str | None = None
    """Chunk compression."""
    compute_dtype: str | None = None
    """The dtype the forward computed in."""
    seq_len: int | None = None
    """Positions per row."""
    hidden_size: int | None = None
    """Values per position."""
    format_version: int | None = None
    """Cache format version."""

    def expected(self) -> dict[str, Any]:
        """The fields set (not None): what a reader checks."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


def check_record(identity: Any, where: str) -> str | None:
    """None if `identity` is a well-typed identity record (unknown keys may hold any JSON
    scalar: a newer writer's fields), else what is wrong with it."""
    if not isinstance(identity, dict):
        return f"{where} must be an object, found {type(identity).__name__}"
    for k, v in identity.items():
        types = FIELDS.get(k, ((str, int, float, bool, type(None)),))[0]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            names = "/".join(t.__name__ for t in types)
            return f"{where}.{k} must be {names}, found {v!r}"[:200]
        if k in ("layer", "boundary", "num_layers", "rows", "seq_len", "hidden_size") and v < 0:
            return f"{where}.{k} must be >= 0, found {v}"
    return None


def identity_record(identity: Mapping, header: Mapping) -> dict:
    """The identity record of a new cache: the caller's fields with the header's storage
    facts (which the writer knows best); CacheError if it is not a well-typed record."""
    facts = ("dtype", "codec", "seq_len", "hidden_size", "format_version")
    try:
        ident = json.loads(json.dumps({**identity, **{k: header[k] for k in facts}}))
    except (TypeError, ValueError) as e:
        raise CacheError(f"cache identity must be JSON-serializable: {e}") from None
    bad = check_record(ident, "identity")
    if bad is not None:
        raise CacheError(f"cache identity: {bad}")
    return ident


def identity_diff(old: Any, new: Mapping) -> str:
    """'field: existing X, requested Y' of two identity records."""
    if not isinstance(old, Mapping):
        return f"existing {old!r}"
    keys = sorted(set(old) | set(new))
    return "; ".join(
        f"{k}: existing {old.get(k)!r}, requested {new.get(k)!r}"
        for k in keys
        if old.get(k) != new.get(k)
    )


def cache_identity(manifest: Mapping) -> dict[str, Any]:
    """The identity of a cache from its manifest: its `identity` record (extract caches),
    over what its header and meta say (so a BCD boundary cache has one too)."""
    h, meta = manifest.get("header") or {}, manifest.get("meta") or {}
    out: dict[str, Any] = {
        "format_version": manifest.get("format_version"),
        "dtype": h.get("dtype"),
        "codec": h.get("codec"),
        "seq_len": h.get("seq_len"),
        "hidden_size": h.get("hidden_size"),
    }
    for k in ("split", "tokens", "compute_dtype", "boundary"):
        if meta.get(k) is not None:
            out[k] = meta[k]
    if "boundary" in out:
        out["kind"] = "boundary"
    out.update(manifest.get("identity") or {})
    return out


def _expected(expect: ExtractSpec | Mapping | None) -> dict[str, Any]:
    if expect is None:
        return {}
    if isinstance(expect, ExtractSpec):
        return expect.expected()
    if not isinstance(expect, Mapping):
        raise CacheError(
            f"expect must be a dict or a storage.ExtractSpec, got {type(expect).__name__}"
        )
    unknown = sorted(set(expect) - set(FIELDS))
    if unknown:
        raise CacheError(
            f"expect names unknown identity field(s) {unknown}; known: {', '.join(FIELDS)}"
        )
    return {k: v for k, v in expect.items() if v is not None}


def check_identity(manifest: Mapping, expect: ExtractSpec | Mapping | None, where: str) -> None:
    """Raise IdentityMismatch (one line) unless the cache of `manifest` has every expected
    field's value; `where` names the cache in the message."""
    want = _expected(expect)
    found = cache_identity(manifest)
    diff = [(k, v, found.get(k)) for k, v in want.items() if not _same(v, found.get(k))]
    if not diff:
        return
    what = "; ".join(
        f"{k}: expected {v!r}, found {f!r}" + ("" if f is not None else " (not recorded)")
        for k, v, f in diff
    )
    k0, v0, _ = diff[0]
    hint = HINTS.get(k0, DEFAULT_HINT).format(want=v0)
    raise IdentityMismatch(f"cache {where} is not the one expected: {what}; {hint}")


def _same(want: Any, found: Any) -> bool:
    return want == found and isinstance(want, bool) == isinstance(found, bool)
