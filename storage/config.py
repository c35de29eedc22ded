"""Config of the activation cache (where it lives, how values are stored)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from core.config import MASK, ConfigError, secret_field

DTYPES = ("fp32", "fp16", "bf16", "int8", "fp8_e4m3")
LOSSY_DTYPES = ("int8", "fp8_e4m3")


@dataclass(kw_only=True)
class CacheConfig:
    root: str | None = None
    """Directory (or fsspec URL) holding caches as <root>/<fingerprint>/; null = <run.dir>/cache."""
    dtype: Literal["fp32", "fp16", "bf16", "int8", "fp8_e4m3"] = "bf16"
    """Stored value type; int8 and fp8_e4m3 are lossy (per-token scale stored beside)."""
    codec: Literal["none", "zstd", "blosc-zstd"] = "blosc-zstd"
    """Compression of each sample chunk."""
    shuffle: Literal["none", "byte", "bit"] = "byte"
    """Blosc shuffle filter (blosc-zstd only)."""
    level: int = 3
    """Compression level (zstd / blosc-zstd)."""
    shard_mb: float = 256.0
    """Target uncompressed size of one shard (one writer task) in MiB."""
    codec_threads: int | None = None
    """Threads (de)compressing a shard's chunks in parallel, per process; null = min(4, CPUs), 1 = none."""
    keep: bool = False
    """Keep boundary K-1's cache after boundary K exists (else the rotation drops it)."""
    lease_s: float = 300.0
    """Seconds a reader's lease on a cache lasts unless renewed (every lease_s/3); gc spares it."""

    def __post_init__(self):
        if not 1 <= self.level <= 22:
            raise ConfigError(f"cache.level must be in 1..22, got {self.level}")
        if self.codec_threads is not None and self.codec_threads < 1:
            raise ConfigError(f"cache.codec_threads must be >= 1 or null, got {self.codec_threads}")
        if self.shard_mb <= 0:
            raise ConfigError(f"cache.shard_mb must be > 0, got {self.shard_mb}")
        if not 1 <= self.lease_s < math.inf:  # NaN too
            raise ConfigError(
                f"cache.lease_s must be >= 1 (seconds a reader's lease on a cache lasts), got "
                f"{self.lease_s}"
            )
        if self.shuffle != "none" and self.codec != "blosc-zstd":
            raise ConfigError(
                f"cache.shuffle={self.shuffle!r} needs cache.codec='blosc-zstd' "
                f"(got {self.codec!r}); set cache.shuffle=none"
            )


@dataclass(kw_only=True)
class StorageConfig:
    endpoint_url: str | None = None
    """S3-compatible endpoint, e.g. http://minio:9000; null = AWS (or AWS_ENDPOINT_URL)."""
    region: str | None = None
    """Bucket region; null = from AWS_REGION / AWS_DEFAULT_REGION / ~/.aws/config."""
    key: str | None = secret_field()
    """Access key id (printed and saved as ***); null = AWS chain (AWS_ACCESS_KEY_ID, ~/.aws, roles)."""
    secret: str | None = secret_field()
    """Secret access key, with key (printed and saved as ***); null = AWS credential chain."""
    anon: bool = False
    """Unsigned requests, for public buckets (no credentials looked up)."""
    retries: int = 5
    """Attempts per object-store request before an error is raised."""
    connect_timeout_s: float = 10.0
    """Seconds to wait for a connection to the endpoint."""
    read_timeout_s: float = 60.0
    """Seconds to wait for a response before the request is abandoned and retried."""

    def __post_init__(self):
        if self.endpoint_url is not None:
            scheme, _, host = self.endpoint_url.partition("://")
            if scheme not in ("http", "https") or not host.strip("/"):
                raise ConfigError(
                    f"storage.endpoint_url must look like http(s)://host[:port], got "
                    f"{self.endpoint_url!r}"
                )
            if "@" in host.split("/", 1)[0]:  # user:password@host would be printed and saved
                raise ConfigError(
                    "storage.endpoint_url must not hold credentials (user:password@host); "
                    "give them as storage.key / storage.secret, which are masked when printed"
                )
        for name in ("key", "secret"):
            if getattr(self, name) == MASK:
                raise ConfigError(
                    f"storage.{name} is {MASK!r}, the mask a printed or saved config holds in "
                    f"place of a credential; set the real value (or null for the AWS credential "
                    f"chain), e.g. --set storage.{name}=..."
                )
        if (self.key is None) != (self.secret is None):
            raise ConfigError(
                "storage.key and storage.secret go together: set both, or neither (then the "
                "AWS credential chain is used: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ...)"
            )
        if self.anon and self.key is not None:
            raise ConfigError("storage.anon=true sends unsigned requests: drop storage.key/secret")
        if self.retries < 1:
            raise ConfigError(f"storage.retries must be >= 1, got {self.retries}")
        if self.connect_timeout_s <= 0:
            raise ConfigError(
                f"storage.connect_timeout_s must be > 0, got {self.connect_timeout_s}"
            )
        if self.read_timeout_s <= 0:
            raise ConfigError(f"storage.read_timeout_s must be > 0, got {self.read_timeout_s}")


# A worker process gets the driver's credentials through these environment variables, never
# inside the config payload it is sent (there they read MASK, as in every printed config).
CREDENTIAL_ENV = {"key": "PREINFER_STORAGE_KEY", "secret": "PREINFER_STORAGE_SECRET"}


def credential_env(cfg: StorageConfig) -> dict[str, str]:
    """{variable: value} of the credentials set in `cfg`, for a worker's environment."""
    return {env: getattr(cfg, f) for f, env in CREDENTIAL_ENV.items() if getattr(cfg, f)}


def with_env_credentials(section: dict | None, environ: Mapping[str, str] | None = None) -> dict:
    """A worker's `storage` config section (plain data) with each masked credential taken
    from CREDENTIAL_ENV in `environ` (default: this process's environment): its storage
    options as the driver had them. A credential left null stays null (the AWS chain)."""
    environ = os.environ if environ is None else environ
    out = dict(section or {})
    for f, env in CREDENTIAL_ENV.items():
        if out.get(f) != MASK:
            continue
        if not environ.get(env):
            raise ConfigError(
                f"storage.{f} was set in the driver but did not reach this worker: {env} is "
                "not in its environment (the driver passes it in the workers' Ray runtime_env)"
            )
        out[f] = environ[env]
    return out
