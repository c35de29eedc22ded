"""Where stored bytes live: a local path, or an fsspec URL (`s3://bucket/prefix`, ...).

`path(x)` gives a `pathlib.Path` for a local path (every existing fast path stays: temp file +
fsync + os.replace, readinto into preallocated buffers) and a `RemotePath` for a URL. A
RemotePath has the small part of the Path API the stores use (`/`, name, parent, exists,
is_file, is_dir, stat, read_bytes, read_text, glob, iterdir, unlink, mkdir), backed by fsspec.

Object stores have no rename, but a single-object PUT is atomic: readers see the old object,
the new one, or none, never half of one (multipart uploads too: the object appears when the
upload completes). So "write aside + rename" becomes "PUT the final key" (`put`), and the
ordering rules are unchanged: an object before its done marker, every marker before the
manifest. "Directories" are key prefixes; listing is prefix listing. s3fs's listing cache is
off, so a driver sees the markers its workers wrote.

Options (endpoint, credentials, region, ...) come from `configure(StorageConfig)`, which
`preinfer.run.config.Config` calls when it is built (in the driver and in every Ray worker, which
rebuild the config from plain data). Credentials left unset come from the standard AWS chain
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, ~/.aws, instance roles).
`check(url)` probes the bucket once per process, so an unreachable endpoint, a missing bucket
or missing credentials fail with one clear StorageError before anything is written.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from core.config import ConfigError
from storage.config import StorageConfig

LOCAL_SCHEMES = ("file",)
S3_SCHEMES = ("s3", "s3a")
# object stores have no free-space limit worth checking before a write
UNLIMITED_BYTES = 1 << 62


class StorageError(ConfigError):
    """A storage URL or the object store behind it is unusable; the message says what to do."""


_cfg = StorageConfig()
_checked: set[tuple] = set()
_lock = threading.Lock()


def configure(cfg: StorageConfig | None) -> None:
    """Options of every later remote access in this process (None: defaults)."""
    global _cfg
    _cfg = cfg if cfg is not None else StorageConfig()


def options() -> StorageConfig:
    return _cfg


def _options_key() -> tuple:
    """Every option, credentials included (the repr leaves them out)."""
    return dataclasses.astuple(_cfg)


def is_url(p: Any) -> bool:
    """True for a RemotePath or a `scheme://...` string other than file://."""
    if isinstance(p, RemotePath):
        return True
    if not isinstance(p, str) or "://" not in p:
        return False
    return p.split("://", 1)[0].lower() not in LOCAL_SCHEMES


def path(p: str | Path | RemotePath) -> Path | RemotePath:
    """A Path for a local path (file:// stripped), a RemotePath for a URL."""
    if isinstance(p, RemotePath | Path):
        return p
    p = str(p)
    if is_url(p):
        return RemotePath(p)
    if p.startswith("file://"):
        p = p[len("file://") :]
    return Path(p)


def join(base: str | Path | RemotePath, *parts: str) -> str:
    """`base/part/...` as a string (URLs keep their `scheme://`)."""
    out = path(base)
    for part in parts:
        out = out / part
    return str(out)


def _split(url: str) -> tuple[str, str]:
    """(scheme, 'bucket/key...') of a URL, checked."""
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if not scheme.isidentifier() and not scheme.replace("-", "").isalnum():
        raise StorageError(f"{url!r}: {scheme!r} is not a URL scheme; use s3://bucket/prefix")
    rest = rest.strip("/")
    if not rest:
        raise StorageError(f"{url!r} names no bucket; use {scheme}://bucket/prefix")
    return scheme, rest


def s3_options(cfg: StorageConfig) -> dict:
    """s3fs.S3FileSystem keyword arguments of a StorageConfig."""
    client = {"region_name": cfg.region} if cfg.region else {}
    opts: dict[str, Any] = {
        "anon": cfg.anon,
        "use_listings_cache": False,  # several processes write one prefix: always list afresh
        "client_kwargs": client,
        "config_kwargs": {
            "connect_timeout": cfg.connect_timeout_s,
            "read_timeout": cfg.read_timeout_s,
            "retries": {"total_max_attempts": cfg.retries, "mode": "standard"},
        },
    }
    if cfg.endpoint_url:
        opts["endpoint_url"] = cfg.endpoint_url
    if cfg.key:
        opts["key"], opts["secret"] = cfg.key, cfg.secret
    return opts


_fs_memo: dict[tuple, Any] = {}


def filesystem(scheme: str):
    """The fsspec filesystem of `scheme` with this process's options (one per process)."""
    memo = (scheme, os.getpid(), _options_key())
    if memo not in _fs_memo:
        _fs_memo[memo] = _make_filesystem(scheme)
    return _fs_memo[memo]


def _make_filesystem(scheme: str):
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise StorageError(
            f"unknown storage URL scheme {scheme!r}; use a local path or s3://bucket/prefix "
            "(other fsspec schemes need their package, e.g. gcsfs for gs://)"
        ) from None
    except ImportError as e:
        raise StorageError(
            f"storage URL scheme {scheme!r} needs a package that is not installed ({e}); "
            "pip install it, or use s3://bucket/prefix"
        ) from None
    if scheme in S3_SCHEMES:
        fs = cls(**s3_options(_cfg))
        # botocore makes the storage.retries attempts; s3fs's own loop around each call would
        # multiply them (a read timeout is retried by both)
        fs.retries = 1
        return fs
    return cls()


def check(url: str | RemotePath, what: str = "storage") -> None:
    """Probe the bucket of `url` once per process (and options): StorageError, naming what to
    fix, when the endpoint is unreachable, the bucket is missing or access is refused.
    Local paths pass."""
    if not is_url(url):
        return
    url = str(url)
    scheme, rest = _split(url)
    bucket = rest.split("/", 1)[0]
    key = (scheme, bucket, _options_key())
    if key in _checked:
        return
    fs = filesystem(scheme)
    where = f"{what} {url}"
    if scheme in S3_SCHEMES:
        _probe_s3(fs, bucket, where)
    else:
        try:
            fs.ls(bucket, detail=False)
        except FileNotFoundError:
            raise StorageError(f"{where}: bucket/container {bucket!r} does not exist") from None
        except Exception as e:  # noqa: BLE001 - report whatever the backend says
            raise StorageError(f"{where}: cannot access {scheme}://{bucket} ({e})") from None
    with _lock:
        _checked.add(key)


def _endpoint() -> str:
    return _cfg.endpoint_url or "the default AWS endpoint (or AWS_ENDPOINT_URL)"


def unreachable(e: BaseException, where: str | None = None) -> StorageError | None:
    """The one-line StorageError for an object store that cannot be reached, dropped the
    connection or did not answer (botocore's errors, some of them OSErrors without an errno;
    a Ray task's error is read through to its cause); None for any other exception.
    where: what the start-up probe was checking; None: the store was lost mid-command (the
    line then says how to go on)."""
    try:
        import botocore.exceptions as bx
    except ImportError:  # no S3 support installed: no botocore error either
        return None
    e = getattr(e, "cause", None) or e  # ray.exceptions.RayTaskError
    head = f"{where}: " if where else ""
    if isinstance(e, bx.ReadTimeoutError):
        why = (
            f"the object store at {_endpoint()} took the connection but did not answer within "
            f"storage.read_timeout_s={_cfg.read_timeout_s} s on any of its attempts "
            f"(storage.retries={_cfg.retries}) ({e}); check that the server is healthy, or "
            "raise storage.read_timeout_s"
        )
    elif isinstance(e, bx.ConnectionError | bx.ConnectionClosedError):  # refused, timed out
        why = (
            f"cannot reach the object store at {_endpoint()} ({e}); check "
            "storage.endpoint_url (scheme, host, port) and that the server is running"
        )
    else:
        return None
    if where is None:  # every object is one PUT: what is stored is whole, a build resumes
        why += (
            ", then rerun the same command: what it wrote before the store was lost is kept "
            "(a cache build resumes at its first unfinished shard)"
        )
    return StorageError(head + why)


def _probe_s3(fs, bucket: str, where: str) -> None:
    import botocore.exceptions as bx

    endpoint = _endpoint()
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
        return
    except (bx.ConnectionError, bx.ConnectionClosedError, bx.ReadTimeoutError) as e:
        raise unreachable(e, where) from None
    except bx.NoCredentialsError:
        raise StorageError(
            f"{where}: no credentials for {endpoint}; set storage.key and storage.secret, the "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment variables, or "
            "storage.anon=true for a public bucket"
        ) from None
    except FileNotFoundError:
        raise StorageError(
            f"{where}: bucket {bucket!r} does not exist at {endpoint}; create it (e.g. `aws "
            f"s3 mb s3://{bucket}`, with --endpoint-url for a non-AWS store) or fix the URL"
        ) from None
    except PermissionError as e:
        raise StorageError(
            f"{where}: access to bucket {bucket!r} at {endpoint} is denied ({e}); check the "
            "credentials (storage.key / storage.secret or AWS_* variables) and the bucket policy"
        ) from None
    except OSError as e:
        raise StorageError(f"{where}: bucket {bucket!r} at {endpoint} is unusable ({e})") from None


class RemotePath:
    """A key (or key prefix) in an fsspec filesystem; the Path subset the stores use."""

    __slots__ = ("scheme", "key")

    def __init__(self, url: str):
        self.scheme, self.key = _split(str(url))

    @property
    def fs(self):
        return filesystem(self.scheme)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __fspath__(self):  # a clear error where code would hand a URL to os/open
        raise TypeError(f"{self} is an object-store URL, not a local file path")

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __lt__(self, other) -> bool:
        return str(self) < str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __reduce__(self):
        return RemotePath, (str(self),)

    def __truediv__(self, other) -> RemotePath:
        tail = str(other).strip("/")
        return RemotePath(f"{self}/{tail}") if tail else self

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return (
            RemotePath(f"{self.scheme}://{self.key.rsplit('/', 1)[0]}") if "/" in self.key else self
        )

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def resolve(self) -> RemotePath:
        """Itself: keys are literal names (no symlinks, no `..`)."""
        return self

    def is_relative_to(self, other) -> bool:
        return isinstance(other, RemotePath) and (
            self == other or str(self).startswith(f"{other}/")
        )

    # ---- queries (errors other than "not found" propagate: never a silent False)
    def info(self) -> dict | None:
        try:
            return self.fs.info(self.key)
        except FileNotFoundError:
            return None

    def _file_info(self) -> dict | None:
        """Info of the object at this exact key, None if there is none: on S3 one HEAD (s3fs's
        info() follows a miss with a listing, to find a "directory")."""
        if self.scheme not in S3_SCHEMES:
            i = self.info()
            return i if i is not None and i.get("type") == "file" else None
        bucket, _, key = self.key.partition("/")
        if not key:
            return None
        try:
            r = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        return {"type": "file", "size": r["ContentLength"], "LastModified": r["LastModified"]}

    def exists(self) -> bool:
        return self._file_info() is not None or self.info() is not None

    def is_file(self) -> bool:
        return self._file_info() is not None

    def is_dir(self) -> bool:
        i = self.info()
        return i is not None and i.get("type") == "directory"

    def stat(self) -> SimpleNamespace:
        i = self._file_info() or self.fs.info(self.key)  # FileNotFoundError like Path.stat
        mtime = i.get("LastModified") or i.get("mtime") or i.get("created")
        mtime = mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime or 0.0)
        return SimpleNamespace(st_size=int(i.get("size") or 0), st_mtime=mtime)

    def _wrap(self, names) -> list[RemotePath]:
        return [RemotePath(f"{self.scheme}://{n}") for n in names]

    def iterdir(self) -> list[RemotePath]:
        try:
            names = self.fs.ls(self.key, detail=False)
        except FileNotFoundError:
            return []
        return [p for p in self._wrap(names) if p.key != self.key]

    def glob(self, pattern: str) -> list[RemotePath]:
        return self._wrap(self.fs.glob(f"{self.key}/{pattern}"))

    def find(self) -> dict[str, dict]:
        """{key: info} of every object under this prefix."""
        try:
            return self.fs.find(self.key, detail=True)
        except FileNotFoundError:
            return {}

    def rglob(self, pattern: str) -> list[RemotePath]:
        return self._wrap(k for k in self.find() if fnmatch.fnmatch(k.rsplit("/", 1)[-1], pattern))

    # ---- bytes
    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.key)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data) -> None:
        put(self, data)

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        put(self, text.encode(encoding))

    def open(self, mode: str = "rb", **kw):
        return self.fs.open(self.key, mode, **kw)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """No-op: prefixes exist as soon as an object is under them."""

    def unlink(self, missing_ok: bool = False) -> None:
        if not missing_ok and not self.exists():
            raise FileNotFoundError(str(self))
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise


def as_bytes(data) -> bytes:
    """One bytes object of a buffer or a list/tuple of buffers written back to back."""
    parts = list(data) if isinstance(data, list | tuple) else [data]
    if len(parts) == 1 and isinstance(parts[0], bytes):
        return parts[0]
    return b"".join(memoryview(p).cast("B") for p in parts)


def put(p: RemotePath | str, data) -> None:
    """Store `data` (a buffer or list of buffers) under URL `p` in ONE PUT: atomic on object
    stores (the object appears whole, or not at all)."""
    rp = path(p)
    rp.fs.pipe_file(rp.key, as_bytes(data))


def rmtree(p: RemotePath | Path | str) -> None:
    """Delete a local directory tree (missing is fine) or every object under a URL prefix."""
    if not is_url(p):
        shutil.rmtree(path(p), ignore_errors=True)
        return
    rp = path(p)
    keys = list(rp.find())
    if keys:
        rp.fs.rm(keys)


def du(p: RemotePath | str) -> int:
    """Bytes of all objects under a prefix (0 if none)."""
    return sum(int(i.get("size") or 0) for i in path(p).find().values())


def newest_mtime(p: RemotePath | str, default: float = 0.0) -> float:
    """Latest modification time of the objects under a prefix (`default` if none)."""
    times = [
        i["LastModified"].timestamp() for i in path(p).find().values() if i.get("LastModified")
    ]
    return max(times, default=default)


def open_read(p):
    """A binary file object for reading a local path or a URL (e.g. for pyarrow)."""
    p = path(p)
    return p.open("rb")


def parquet_source(p):
    """What pyarrow.parquet reads: the path string (local) or an open fsspec file (URL)."""
    p = path(p)
    return p.open("rb") if isinstance(p, RemotePath) else str(p)


_SECRET_KEYS = ("key", "secret")


def redact(obj: Any) -> Any:
    """`obj` (config dict, meta holding one, ...) with every `storage` section's key/secret
    masked: what gets persisted (manifests, build files) never holds credentials."""
    if isinstance(obj, dict):
        return {
            k: (
                {kk: ("***" if kk in _SECRET_KEYS and vv else vv) for kk, vv in v.items()}
                if k == "storage" and isinstance(v, dict)
                else redact(v)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj
