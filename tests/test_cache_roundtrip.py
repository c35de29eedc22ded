"""Activation cache: bit-exact round trips, lossy formats, determinism, bad inputs."""

import json

import numpy as np
import pytest
import torch
import xxhash
import zarr
from zarr.storage import LocalStore

from storage import cache as cache_mod
from storage import codecs
from storage.cache import CacheWriter
from storage.config import CacheConfig
from storage.layout import CacheError, estimate_cache_bytes
from storage.reader import open_cache
from storage.shard_codec import (
    MAX_U64,
    _zarr_decode_shard,
    _zarr_encode_shard,
    decode_shard,
    encode_shard,
    shard_codec,
)
from storage.stats import STATS_BLOCK, shard_stats, shard_stats_sampled
from storage.values import CodecError, decode, encode, stored_dtype

N, S, H, R = 40, 8, 16, 8  # 40 samples in shards of 8 rows -> 5 shards


def samples(n=N, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(-100, 1000, (n, S))
    labels[:, 0] = np.arange(n)  # row id, so tests can tell rows apart
    return np.arange(n) * 3 + 7, rng.integers(0, 1000, (n, S)), labels


def cfg(dtype="bf16", codec="none", shuffle="none", rows=R, **kw):
    item = stored_dtype(dtype).itemsize
    return CacheConfig(
        dtype=dtype, codec=codec, shuffle=shuffle, shard_mb=rows * S * H * item / 2**20, **kw
    )


def hidden(dtype=torch.float32, n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, S, H, generator=g) * 3
    x[0, 0] = 0.0
    x[1] = -0.0  # a whole sample of -0.0 == fill value: must still keep its sign bits
    x[24:32] = 0.0  # an all-zero shard (zarr skips all-fill chunks unless told not to)
    return x.to(dtype)


def build(root, fp, x, c, meta=None, finalize=True, **kw):
    w = CacheWriter.create(
        root,
        fp,
        samples=samples(),
        seq_len=S,
        hidden_size=H,
        cache_cfg=c,
        meta=meta or {"boundary": 1, "split": "train"},
        **kw,
    )
    for i in w.missing_shards():
        a, b = w.shard_range(i)
        w.write_shard(i, x[a:b])
    if finalize:
        w.finalize()
    return w


CODECS = [
    ("none", "none"),
    ("zstd", "none"),
    ("blosc-zstd", "none"),
    ("blosc-zstd", "byte"),
    ("blosc-zstd", "bit"),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("codec,shuffle", CODECS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lossless_round_trip_is_bit_exact(tmp_path, dtype, codec, shuffle):
    x = hidden(DTYPES[dtype])
    w = build(tmp_path, "fp", x, cfg(dtype, codec, shuffle))
    assert w.num_shards == 5
    c = open_cache(tmp_path, "fp", verify=True)
    assert (c.num_samples, c.seq_len, c.hidden_size, c.num_shards) == (N, S, H, 5)
    got, labels, sids = c.read_rows(0, N, dtype=None)
    assert got.dtype == DTYPES[dtype]
    as_int = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    assert torch.equal(got.view(as_int[x.dtype]), x.view(as_int[x.dtype]))  # bits, incl. -0.0
    sid, _, lab = samples()
    assert torch.equal(labels, torch.from_numpy(lab)) and labels.dtype == torch.long
    assert torch.equal(sids, torch.from_numpy(sid))
    h3, l3, s3 = c.read_shard(3)  # default float32
    assert h3.dtype == torch.float32 and torch.equal(h3, x[24:32].float())
    assert torch.equal(s3, torch.from_numpy(sid[24:32]))
    h, _, _ = c.read_rows(5, 19)  # spans shards 0..2
    assert torch.equal(h, x[5:19].float())
    m = c.manifest
    assert m["error"] is None and m["meta"]["boundary"] == 1 and m["dtype"] == dtype
    assert m["stats"]["absmax"] == pytest.approx(float(x.float().abs().max()))
    # sums are fp32 within blocks (float64 across): fp32-level accuracy, not float64's
    assert m["stats"]["mean"] == pytest.approx(float(x.double().mean()), abs=1e-6)
    assert m["stats"]["std"] == pytest.approx(float(x.double().std(unbiased=False)), rel=1e-6)
    assert m["total_bytes"] > m["value_bytes"] > 0
    attrs = json.loads((tmp_path / "fp/hidden.zarr/zarr.json").read_text())["attributes"]
    assert attrs["preinfer"]["dtype"] == dtype  # bf16 stored as uint16 with logical dtype here


def test_fp32_input_to_bf16_records_rounding_error(tmp_path):
    x = hidden(torch.float32)
    build(tmp_path, "fp", x, cfg("bf16", "zstd"))
    c = open_cache(tmp_path, "fp")
    got = c.read_rows(0, N, dtype=None)[0]
    assert torch.equal(got, x.to(torch.bfloat16))
    err = (got.float() - x).abs()
    assert c.manifest["error"]["max_abs_err"] == pytest.approx(float(err.max()))
    assert c.manifest["error"]["mean_abs_err"] == pytest.approx(float(err.double().mean()))


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_lossy_within_recorded_error_and_no_nan_with_outliers(tmp_path, dtype):
    x = hidden(torch.float32) * 1e-3
    x[2:6, :, 3] = 1e4  # outliers next to 1e-3 values in the same tokens
    x[7, 2] = 0.0  # an all-zero token: scale 0 must decode to zeros, not NaN
    x[9, 1, :] = -65504.0 * 4
    build(tmp_path, "fp", x, cfg(dtype, "blosc-zstd", "byte"))
    c = open_cache(tmp_path, "fp", verify=True)
    got = c.read_rows(0, N)[0]
    assert torch.isfinite(got).all()
    assert torch.equal(got[7, 2], torch.zeros(H))
    err = (got - x).abs()
    rec = c.manifest["error"]
    assert float(err.max()) <= rec["max_abs_err"] * (1 + 1e-6)
    assert rec["max_abs_err"] == pytest.approx(float(err.max()))
    assert rec["rel_err"] == pytest.approx(float((got - x).double().norm() / x.double().norm()))
    absmax = x.abs().amax(-1, keepdim=True)
    if dtype == "int8":
        bound = absmax / 254 * (1 + 1e-5)  # half a quantization step
    else:  # 3 mantissa bits: rel 2^-4 for normals; subnormal step 2^-9 of the scale
        bound = torch.maximum(x.abs() * 2**-4, absmax / 448 * 2**-10) * (1 + 1e-5) + 1e-30
    assert (err <= bound).all()
    assert (got[2:6, :, 3] == 1e4).all()  # the absmax value itself is exact
    assert (tmp_path / "fp/scale.zarr/zarr.json").exists()


def test_codec_refuses_nan_overflow_and_bad_types():
    with pytest.raises(CodecError, match="NaN"):
        encode(torch.tensor([[[1.0, float("nan")]]]), "bf16")
    with pytest.raises(CodecError, match="overflow fp16"):
        encode(torch.tensor([[[1e5]]]), "fp16")
    with pytest.raises(CodecError, match="float32/float16"):
        encode(np.zeros((1, 1, 2), np.int64), "fp32")
    with pytest.raises(CodecError, match="blosc-zstd"):
        codecs.compressors(CacheConfig(codec="blosc-zstd", level=12))
    q, s = encode(torch.zeros(2, 3, 4), "fp8_e4m3")
    assert (s == 0).all() and torch.equal(decode(q, s, "fp8_e4m3"), torch.zeros(2, 3, 4))


def test_same_shard_twice_gives_identical_bytes_equal_to_zarr(tmp_path):
    x = hidden(torch.bfloat16)
    c = cfg("bf16", "blosc-zstd", "bit")
    w = build(tmp_path, "fp", x, c, finalize=False)
    shard = tmp_path / "fp/hidden.zarr/c/4/0/0"  # last shard: rows 32..40
    first, marker1 = shard.read_bytes(), (tmp_path / "fp/done/00004.json").read_bytes()
    w2 = CacheWriter.create(
        tmp_path, "fp", samples=samples(), seq_len=S, hidden_size=H, cache_cfg=c, meta={}
    )
    w2.write_shard(4, x[32:40])
    assert shard.read_bytes() == first
    assert (tmp_path / "fp/done/00004.json").read_bytes() == marker1
    # what zarr itself writes into an empty store with the same metadata: the same bytes
    (tmp_path / "z").mkdir()
    (tmp_path / "z/zarr.json").write_bytes((tmp_path / "fp/hidden.zarr/zarr.json").read_bytes())
    arr = zarr.open_array(LocalStore(tmp_path / "z")).with_config({"write_empty_chunks": True})
    arr[32:40] = x[32:40].view(torch.int16).numpy().view(np.uint16)
    assert (tmp_path / "z/c/4/0/0").read_bytes() == first
    m = json.loads(marker1)
    entry = m["files"]["hidden.zarr/c/4/0/0"]
    assert entry["checksum"] == {"algo": "xxh3_128", "value": xxhash.xxh3_128(first).hexdigest()}
    assert entry["bytes"] == len(first)
    # and a complete cache refuses a rewrite that would change it
    w.finalize()
    w2.write_shard(4, x[32:40])  # identical: no-op
    with pytest.raises(CacheError, match="immutable"):
        w2.write_shard(4, x[32:40] + 1)


def test_bad_inputs_are_clear_errors(tmp_path):
    c = cfg("bf16")
    w = build(tmp_path, "fp", hidden(), c, finalize=False)
    with pytest.raises(CacheError, match=r"shape \(8, 8, 16\)"):
        w.write_shard(0, torch.zeros(7, S, H))
    with pytest.raises(CacheError, match="out of range"):
        w.write_shard(5, torch.zeros(8, S, H))
    with pytest.raises(CacheError, match="NaN"):
        w.write_shard(0, torch.full((8, S, H), float("nan")))
    with pytest.raises(CacheError, match="another layout"):  # same fp, other dtype
        CacheWriter.create(
            tmp_path,
            "fp",
            samples=samples(),
            seq_len=S,
            hidden_size=H,
            cache_cfg=cfg("fp16"),
            meta={},
        )
    with pytest.raises(CacheError, match="other samples"):
        CacheWriter.create(
            tmp_path, "fp", samples=samples(seed=5), seq_len=S, hidden_size=H, cache_cfg=c, meta={}
        )
    sid, ids, lab = samples()
    with pytest.raises(CacheError, match="duplicates"):
        CacheWriter.create(
            tmp_path,
            "g",
            samples=(np.zeros(N, int), ids, lab),
            seq_len=S,
            hidden_size=H,
            cache_cfg=c,
            meta={},
        )
    with pytest.raises(CacheError, match="shape"):
        CacheWriter.create(
            tmp_path,
            "g",
            samples=(sid, ids[:, :4], lab),
            seq_len=S,
            hidden_size=H,
            cache_cfg=c,
            meta={},
        )
    with pytest.raises(CacheError, match="JSON"):
        CacheWriter.create(
            tmp_path,
            "g",
            samples=(sid, ids, lab),
            seq_len=S,
            hidden_size=H,
            cache_cfg=c,
            meta={"x": object()},
        )
    with pytest.raises(CacheError, match="fingerprint"):
        CacheWriter.create(
            tmp_path,
            "../x",
            samples=(sid, ids, lab),
            seq_len=S,
            hidden_size=H,
            cache_cfg=c,
            meta={},
        )


def test_samples_as_arrow_table_equal_arrays(tmp_path):
    from storage.samples import samples_arrays, samples_table

    t = samples_table(*(np.asarray(a) for a in samples()))
    assert str(t.schema.field("input_ids").type) == "list<item: int32>"
    for a, b in zip(samples_arrays(t, S), samples(), strict=True):
        assert np.array_equal(a, b)
    w = CacheWriter.create(
        tmp_path, "fp", samples=t, seq_len=S, hidden_size=H, cache_cfg=cfg(), meta={}
    )
    assert w.num_shards == 5 and w.shard_range(4) == (32, 40)


def test_disk_guard(tmp_path, monkeypatch):
    need = estimate_cache_bytes(N, S, H, "fp32")
    assert need >= N * S * H * 4
    with pytest.raises(CacheError, match=r"needs up to \d+ bytes .* only 1000 bytes"):
        CacheWriter.create(
            tmp_path,
            "fp",
            samples=samples(),
            seq_len=S,
            hidden_size=H,
            cache_cfg=cfg("fp32"),
            meta={},
            free_bytes=1000,
        )
    assert not (tmp_path / "fp").exists()  # refused before writing anything
    monkeypatch.setattr(cache_mod, "free_disk_bytes", lambda p: 10)
    with pytest.raises(CacheError, match="only 10 bytes"):
        CacheWriter.create(
            tmp_path,
            "fp",
            samples=samples(),
            seq_len=S,
            hidden_size=H,
            cache_cfg=cfg("fp32"),
            meta={},
        )
    CacheWriter.create(
        tmp_path,
        "fp",
        samples=samples(),
        seq_len=S,
        hidden_size=H,
        cache_cfg=cfg("fp32"),
        meta={},
        free_bytes=need,
    )


# ------------------------------------------------ shard bytes: our encoder vs zarr's own

STORED = {"fp32": "float32", "fp16": "float16", "bf16": "uint16", "int8": "int8"}
STORED["fp8_e4m3"] = "uint8"


def _values(shape, np_dtype, seed=0):
    g = np.random.default_rng(seed)
    if np.dtype(np_dtype).kind == "f":
        x = (g.standard_normal(shape) * 3).astype(np_dtype)
        x.reshape(shape[0], -1)[0, :3] = (0.0, -0.0, 1.0)  # fill value and -0.0 stay chunks
        return x
    return g.integers(np.iinfo(np_dtype).min, np.iinfo(np_dtype).max, shape).astype(np_dtype)


@pytest.mark.parametrize("codec,shuffle", CODECS)
@pytest.mark.parametrize("dtype", list(STORED))
def test_shard_bytes_equal_zarr_for_every_dtype_and_codec(dtype, codec, shuffle):
    c = CacheConfig(dtype=dtype, codec=codec, shuffle=shuffle, level=5)
    np_dtype = np.dtype(STORED[dtype])
    # [N, S, H] values and the [N, S] scale layout; R divides N or leaves a short last shard
    for shape, rows in (((11, 3, 5), 4), ((8, 2, 4), 8), ((5, 6), 2), ((3, 2, 2), 1)):
        meta = codecs.array_json(shape, rows, np_dtype, c, {"x": 1})
        sc = shard_codec(meta)
        assert sc.fast, sc.why_slow
        x = _values(shape, np_dtype)
        for i in range(-(-shape[0] // rows)):
            a, b = i * rows, min((i + 1) * rows, shape[0])
            ours = encode_shard(meta, i, a, x[a:b])
            assert ours == _zarr_encode_shard(meta, i, a, x[a:b]), (shape, i)
            for s0, s1 in ((a, b), (a, a + 1), (b - 1, b)):  # whole shard and single rows
                got = decode_shard(meta, i, ours, s0, s1)
                assert got.dtype == np_dtype and got.shape == x[s0:s1].shape
                assert got.tobytes() == x[s0:s1].tobytes()
                ref = _zarr_decode_shard(meta, i, ours, s0, s1)
                assert ref.tobytes() == got.tobytes()
        if len(shape) == 3 and shape[0] % rows:  # rows written past the array's end: absent
            last = encode_shard(meta, shape[0] // rows, shape[0] // rows * rows,
                                       x[shape[0] // rows * rows:])  # fmt: skip
            index = sc.read_index(np.frombuffer(last, np.uint8))
            assert (index[shape[0] % rows :] == MAX_U64).all()


def test_blosc_and_zstd_parameters_are_zarrs():
    for dtype, shuffle in (("bf16", "byte"), ("fp32", "bit"), ("int8", "none")):
        c = CacheConfig(dtype=dtype, codec="blosc-zstd", shuffle=shuffle, level=7)
        meta = codecs.array_json((4, 2, 3), 2, np.dtype(STORED[dtype]), c, {})
        arr = zarr.open_array(zarr.storage.MemoryStore({"zarr.json": _buf(meta)}))
        (zblosc,) = arr.metadata.codecs[0].codecs[1:]
        ours = shard_codec(meta).compressor
        want = zblosc._blosc_codec
        assert (ours.cname, ours.clevel, ours.shuffle, ours.blocksize, ours._typesize) == (
            want.cname, want.clevel, want.shuffle, want.blocksize, want._typesize
        )  # fmt: skip
        assert ours._typesize == np.dtype(STORED[dtype]).itemsize
    meta = codecs.array_json((4, 2, 3), 2, np.dtype("uint16"), CacheConfig(codec="zstd",
                             shuffle="none", level=4), {})  # fmt: skip
    z = shard_codec(meta).compressor
    assert (z.level, z.checksum) == (4, False)


def _buf(b: bytes):
    from zarr.core.buffer import default_buffer_prototype

    return default_buffer_prototype().buffer.from_bytes(b)


def test_morton_order_of_a_row_chunk_grid_is_row_order():
    from zarr.core.indexing import _morton_order

    for r in [*range(1, 70), 127, 128, 129, 1000]:
        for shape in ((r, 1, 1), (r, 1)):
            order = np.asarray(_morton_order(shape))
            assert (order[:, 0] == np.arange(r)).all() and (order[:, 1:] == 0).all()


def test_index_at_start_and_unknown_metadata_fall_back_to_zarr():
    c = CacheConfig(dtype="bf16", codec="zstd", shuffle="none")
    meta = codecs.array_json((7, 2, 3), 3, np.dtype("uint16"), c, {})
    x = _values((7, 2, 3), np.uint16)
    m = json.loads(meta)
    m["codecs"][0]["configuration"]["index_location"] = "start"
    start = json.dumps(m).encode()
    assert shard_codec(start).fast
    for i, (a, b) in enumerate(((0, 3), (3, 6), (6, 7))):
        ours = encode_shard(start, i, a, x[a:b])
        assert ours == _zarr_encode_shard(start, i, a, x[a:b])
        assert decode_shard(start, i, ours, a, b).tobytes() == x[a:b].tobytes()
    m["codecs"][0]["configuration"]["index_codecs"] = [
        {"name": "bytes", "configuration": {"endian": "little"}}
    ]  # no crc32c: still ours
    m["codecs"][0]["configuration"]["index_location"] = "end"
    nocrc = json.dumps(m).encode()
    assert shard_codec(nocrc).fast
    assert encode_shard(nocrc, 0, 0, x[:3]) == _zarr_encode_shard(nocrc, 0, 0, x[:3])
    m["codecs"][0]["configuration"]["codecs"].insert(
        0, {"name": "transpose", "configuration": {"order": [0, 2, 1]}}
    )  # a layout we do not implement: zarr itself encodes it
    odd = json.dumps(m).encode()
    assert not shard_codec(odd).fast
    blob = encode_shard(odd, 1, 3, x[3:6])
    assert blob == _zarr_encode_shard(odd, 1, 3, x[3:6])
    assert decode_shard(odd, 1, blob, 3, 6).tobytes() == x[3:6].tobytes()


def test_damaged_shard_index_is_a_codec_error():
    c = CacheConfig(dtype="bf16", codec="none", shuffle="none")
    meta = codecs.array_json((4, 2, 3), 4, np.dtype("uint16"), c, {})
    blob = bytearray(encode_shard(meta, 0, 0, _values((4, 2, 3), np.uint16)))
    blob[-10] ^= 1  # inside the index: crc32c catches it
    with pytest.raises(CodecError, match="crc32c"):
        decode_shard(meta, 0, bytes(blob), 0, 4)
    with pytest.raises(CodecError, match="fewer than its index"):
        decode_shard(meta, 0, b"\0" * 10, 0, 4)


@pytest.mark.parametrize("codec,shuffle", [("none", "none"), ("blosc-zstd", "bit")])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "int8"])
def test_plain_zarr_reads_the_cache(tmp_path, dtype, codec, shuffle):
    x = hidden(DTYPES.get(dtype, torch.float32), n=37)
    w = CacheWriter.create(
        tmp_path,
        "fp",
        samples=samples(37),
        seq_len=S,
        hidden_size=H,
        cache_cfg=cfg(dtype, codec, shuffle, rows=6),  # 7 shards, the last one short
        meta={},
    )
    for i in range(w.num_shards):
        w.write_shard(i, x[slice(*w.shard_range(i))])
    w.finalize()
    c = open_cache(tmp_path, "fp")
    stored, scale = c.read_stored(0, 37)
    arr = zarr.open_array(LocalStore(tmp_path / "fp/hidden.zarr", read_only=True))
    assert arr.shape == (37, S, H) and arr.dtype == stored.dtype
    assert arr[:].tobytes() == stored.tobytes()
    assert arr[5:13].tobytes() == stored[5:13].tobytes()
    if scale is not None:
        sarr = zarr.open_array(LocalStore(tmp_path / "fp/scale.zarr", read_only=True))
        assert sarr[:].tobytes() == scale.tobytes()


# ------------------------------------------------------------------------- value stats


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stats_are_exact_over_every_value_and_deterministic(dtype):
    g = torch.Generator().manual_seed(5)
    n = STATS_BLOCK * 2 + 7  # several blocks and an odd tail
    x = (torch.randn(n, generator=g) * 2 + 0.25).to(dtype)
    x[n // 2 + 3] = -40.0  # the absmax sits in one value only (a subsample would miss it)
    st = shard_stats(x)
    d = x.double()
    assert st["count"] == n and st["absmax"] == 40.0
    assert st["sum"] == pytest.approx(float(d.sum()), abs=1e-6 * float(d.abs().sum()))
    assert st["sumsq"] == pytest.approx(float((d * d).sum()), rel=1e-5)
    big = torch.zeros(n + 1, dtype=dtype)
    big[1:] = x  # the same values at another alignment: the same stats, bit for bit
    assert shard_stats(big[1:]) == st


def test_stats_catch_nonfinite_values_and_survive_fp32_overflow():
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.ones(1001, dtype=dtype)
            x[500] = bad
            with pytest.raises(CodecError, match="1 of 1001 values are NaN/inf"):
                shard_stats(x)
    x = torch.tensor([3e38, 3e38, -1e38, 5.0])  # finite, but its fp32 sums overflow
    st = shard_stats(x.to(torch.bfloat16))
    assert st["absmax"] == pytest.approx(3e38, rel=1e-2) and np.isfinite(st["sumsq"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sampled_stats_keep_absmax_and_nan_check_exact(dtype):
    from storage.stats import bits_absmax

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 8, 16, generator=g) * 2 + 0.25).to(dtype)  # 8192 values
    x[13, 5, 2] = -40.0  # row 13: not in the row sample (stride 8 -> rows 0, 8, ... 56)
    st = shard_stats_sampled(x, budget=1024)
    assert st["row_stride"] == 8 and st["values"] == x.numel() and st["count"] == 8 * 128
    assert st["absmax"] == 40.0  # every value, from the bits
    sub = x[::8].double()
    assert st["sum"] == pytest.approx(float(sub.sum()), abs=1e-4)
    assert st["sumsq"] == pytest.approx(float((sub * sub).sum()), rel=1e-5)
    assert shard_stats_sampled(x.clone(), budget=1024) == st  # deterministic
    assert shard_stats_sampled(x, budget=x.numel()) == shard_stats(x)  # small
    y = x.clone()
    for bad in (float("nan"), float("inf"), -float("inf")):
        y[13, 0, 0] = bad  # an unsampled row: still caught
        with pytest.raises(CodecError, match=f"1 of {x.numel()} values are NaN/inf"):
            shard_stats_sampled(y, budget=1024)
    neg = -x.abs()  # only negatives; -0.0 and 0.0 give 0
    assert bits_absmax(neg) == (40.0, False)
    assert bits_absmax(torch.full((5,), -0.0, dtype=dtype)) == (0.0, False)


def test_manifest_records_sampled_stats_and_old_manifests_validate(tmp_path, monkeypatch):
    from storage import stats
    from storage.manifest import validate_manifest

    monkeypatch.setattr(stats, "STATS_SAMPLE_VALUES", 256)  # shards of 8 x 8 x 16 values
    x = hidden(torch.bfloat16)
    build(tmp_path, "fp", x, cfg("bf16"))
    c = open_cache(tmp_path, "fp", verify=True)
    m = c.manifest
    assert m["stats_sampling"]["shards_sampled"] == 5
    assert m["stats_sampling"]["values"] == x.numel()
    assert m["stats_sampling"]["values_summed"] == x.numel() // 4  # every 4th row
    assert m["stats"]["absmax"] == float(x.float().abs().max())  # exact
    assert torch.equal(c.read_rows(0, N, dtype=None)[0].view(torch.int16), x.view(torch.int16))
    old = {k: v for k, v in m.items() if k != "stats_sampling"}  # a manifest of before
    validate_manifest(old, tmp_path / "fp")
    validate_manifest({**m, "stats_sampling": None}, tmp_path / "fp")
    with pytest.raises(cache_mod.CacheCorrupt, match="stats_sampling.values"):
        validate_manifest({**m, "stats_sampling": {**m["stats_sampling"], "values": "x"}}, c.dir)


def test_writer_refuses_nan_and_bf16_overflow(tmp_path):
    good = hidden(torch.bfloat16)
    w = build(tmp_path, "fp", good, cfg("bf16"), finalize=False)
    shard0 = sorted(p for p in tmp_path.glob("fp/hidden.zarr/c/0/**/*") if p.is_file())
    before = {p: p.read_bytes() for p in [*shard0, tmp_path / "fp/done/00000.json"]}
    x = good[:8].clone()
    x[3, 2, 1] = float("nan")
    with pytest.raises(CacheError, match=r"shard 0 .*1 of 1024 hidden values are NaN/inf"):
        w.write_shard(0, x)
    y = hidden(torch.float32)[:8].clone()
    y[0, 0, 0] = 3.4e38  # finite fp32, rounds to inf in bf16
    with pytest.raises(CacheError, match="overflow bf16"):
        w.write_shard(0, y)
    assert not list(tmp_path.rglob("*.partial"))  # the aside copies were discarded
    # the refused writes changed nothing: shard 0's file and marker are the good ones ...
    assert {p: p.read_bytes() for p in before} == before
    # ... so the cache finalizes, verifies, and reads back exactly the good values
    manifest = w.finalize()
    assert manifest["stats"]["absmax"] == float(good.float().abs().max())
    c = open_cache(tmp_path, "fp", verify=True)
    assert c.verify() == []
    assert torch.equal(c.read_rows(0, N, dtype=None)[0].view(torch.int16), good.view(torch.int16))


@pytest.mark.parametrize(
    "codec,shuffle", [("none", "none"), ("zstd", "none"), ("blosc-zstd", "byte")]
)
@pytest.mark.parametrize("given", [torch.bfloat16, torch.float32])
def test_shard_from_compressed_pieces_is_byte_identical(tmp_path, codec, shuffle, given):
    """A worker compresses each micro-batch as it is computed (encode_rows) and hands the pieces
    to write_shard: the shard files are the bytes of the whole-shard path, at any cut."""
    x = hidden(given)
    whole = build(tmp_path, "whole", x, cfg("bf16", codec, shuffle))
    w = CacheWriter.create(tmp_path, "pieces", samples=samples(), seq_len=S, hidden_size=H,
                           cache_cfg=cfg("bf16", codec, shuffle), meta={"boundary": 1,
                                                                       "split": "train"})  # fmt: skip
    for i in range(w.num_shards):
        a, b = w.shard_range(i)
        cuts = [a, a + 3, a + 3, a + 4, b] if b - a > 4 else [a, b]  # uneven, one empty piece
        pieces = [w.encode_rows(x[p:q]) for p, q in zip(cuts, cuts[1:], strict=False)]
        w.write_shard(i, x[a:b], encoded=pieces)
    w.finalize()
    for i in range(w.num_shards):
        key = f"hidden.zarr/c/{i}/0/0"
        assert (tmp_path / "pieces" / key).read_bytes() == (tmp_path / "whole" / key).read_bytes()
    assert [s["files"] for s in open_cache(tmp_path, "pieces").manifest["shards"]] == [
        s["files"] for s in whole.finalize()["shards"]
    ]


def test_pieces_must_cover_the_shard_and_lossy_caches_take_whole_shards(tmp_path):
    x = hidden()
    w = CacheWriter.create(tmp_path, "a", samples=samples(), seq_len=S, hidden_size=H,
                           cache_cfg=cfg("bf16", "zstd"), meta={})  # fmt: skip
    with pytest.raises(CacheError, match="pieces hold 3 rows, the shard 8"):
        w.write_shard(0, x[0:8], encoded=[w.encode_rows(x[0:3])])
    assert w.missing_shards() == list(range(w.num_shards))  # nothing committed
    q = CacheWriter.create(tmp_path, "q", samples=samples(), seq_len=S, hidden_size=H,
                           cache_cfg=cfg("int8", "zstd"), meta={})  # fmt: skip
    assert q.encode_rows(x[0:3]) is None
    with pytest.raises(CacheError, match="whole shards"):
        q.write_shard(0, x[0:8], encoded=[w.encode_rows(x[0:8])])
