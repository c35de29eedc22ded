"""Storage: the activation cache (Zarr v3 values + Parquet samples), the token store,
manifests and checksums, on local disk or object storage (s3://). Imports only core/.

The public surface, for reusing a cache you paid for (probes, SAEs, distillation):

    from storage import open_cache, CacheDataset, to_hf_dataset
    cache = open_cache("runs/demo/cache", fingerprint)     # refuses incomplete / damaged caches
    hidden, labels, sample_ids = cache.read_rows(0, 64)     # (64, S, H) fp32, (64, S), (64,)
    ds = CacheDataset(cache, batch_size=16)                  # a torch IterableDataset
    hf = to_hf_dataset(cache)                                # a `datasets.Dataset` view

These are functions of a Cache, not methods: storage.dataset and storage.hf_view import
storage.reader, so a method on Cache would make an import cycle. to_hf_dataset streams the
cache shard by shard into memory-mapped Arrow files (HF's datasets cache, or cache_dir=).
examples/probe.py trains a linear probe on a cache with these imports.
"""

from storage.cache import CacheWriter
from storage.cache_tools import gc_caches, inspect_cache, list_caches, verify_cache
from storage.config import CacheConfig, StorageConfig
from storage.dataset import CacheDataset
from storage.hf_view import hf_to_torch, to_hf_dataset
from storage.identity import ExtractSpec, IdentityMismatch
from storage.layout import CacheError
from storage.reader import Cache, open_cache
from storage.tokens import TokenStore, TokenStoreError

__all__ = [
    "Cache", "CacheConfig", "CacheDataset", "CacheError", "CacheWriter", "ExtractSpec",
    "IdentityMismatch", "StorageConfig",
    "TokenStore", "TokenStoreError", "gc_caches", "hf_to_torch", "inspect_cache", "list_caches",
    "open_cache", "to_hf_dataset", "verify_cache",
]  # fmt: skip
