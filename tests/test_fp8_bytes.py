"""bench/fp8_bytes.py: the fp8 codes' bytes under each coder, never below their entropy bounds,
and the cache's own bytes beside them."""

from __future__ import annotations

from bench import fp8_bytes
from tests.pipeline_fixtures import write_small_cache


def test_coders_and_bounds_of_the_fp8_codes(tmp_path):
    write_small_cache(tmp_path, "c0", N=24, S=8, H=64)
    res = fp8_bytes.main(["--cache-root", str(tmp_path), "--fingerprint", "c0",
                          "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert res["rows"] == 24 and res["hidden_size"] == 64
    scale = 4 / 64
    order0 = res["bounds_bytes_per_value"]["order-0 entropy of the codes"]
    by_channel = res["bounds_bytes_per_value"]["entropy given the channel"]
    assert scale < by_channel <= order0 <= 1 + scale  # conditioning never adds entropy
    # gaussian values: a random sign, and 3 mantissa bits near uniform
    parts = res["part_entropy_bits"]
    assert parts["sign"] > 0.99 and parts["mantissa"] > 2.9 and 0 < parts["exponent"] < 4
    for v in res["fp8_bytes_per_value"].values():
        assert v >= order0 - 0.02  # a coder of one table per chunk: not below order 0 (+ headers)
    # the cache's own bytes: bf16 zstd of the same values (about 2 bytes each)
    assert res["stored"]["dtype"] == "bf16" and 1.2 < res["stored"]["bytes_per_value"] < 2.3
    ratio = res["ratio_to_stored"]["zstd 3"]
    assert ratio == res["fp8_bytes_per_value"]["zstd 3"] / res["stored"]["bytes_per_value"]
