"""`preinfer cache extract`: hidden states at chosen layers, one cache per layer from one
forward, with an identity in the manifest that every reader checks (pipelines/extract.py,
storage/identity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines import cli, extract_worker
from pipelines import extract as ex
from pipelines.extract import ExtractConfig, model_hash, run_extract, spec_for
from pipelines.init import run_init
from preinfer.checkpoint.store import Checkpoint
from storage import (
    CacheDataset,
    ExtractSpec,
    IdentityMismatch,
    list_caches,
    open_cache,
    to_hf_dataset,
    verify_cache,
)
from storage.cache import CacheWriter
from storage.config import CacheConfig
from storage.layout import MANIFEST, CacheCorrupt, CacheError
from storage.tokens import TokenStore
from tests.pipeline_fixtures import TINY, quiet, write_small_cache


def _hf_hidden_states(cfg, ids: torch.Tensor) -> tuple:
    """The model's own forward (transformers, output_hidden_states) over `ids`."""
    model, _ = Checkpoint.open(cfg.run.checkpoint).load()
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states, model


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_layers_equal_the_models_own_hidden_states(tiny_run, tmp_path, arch):
    extra = ["cache.dtype=fp32", "run.device=cpu"]
    if arch == "llama":  # a llama checkpoint over the same tokens
        extra += ["model.arch=llama", f"run.checkpoint={tmp_path / 'llama'}"]
    cfg = tiny_run(*extra)
    if arch == "llama":
        run_init(cfg, log=quiet)
    L = Checkpoint.open(cfg.run.checkpoint).num_layers
    res = run_extract(cfg, ExtractConfig(layers=(L, 0, 2), max_rows=40), log=quiet)
    assert res["action"] == "extracted" and res["rows"] == 40
    assert sorted(res["layers"]) == ["0", "2", str(L)]
    store = TokenStore(cfg.data.out_dir)
    ids, labels = store.read_with_labels("train", 0, 40)
    hs, model = _hf_hidden_states(cfg, torch.from_numpy(ids[:, :-1]).long())
    for layer in (0, 2, L):
        c = open_cache(cfg.cache.root, res["layers"][str(layer)], expect={"layer": layer})
        hidden, lab, sid = c.read_rows(0, c.num_samples)
        # token ids and sample ids stay with every row
        assert np.array_equal(sid.numpy(), np.arange(40))
        assert np.array_equal(lab.numpy(), labels)
        assert np.array_equal(c.read_stored(0, 1)[0].shape, (1, store.seq_len, c.hidden_size))
        want = hs[layer]
        if layer == L:  # HF's last hidden state has the final norm applied; ours does not
            norm = model.transformer.ln_f if arch == "gpt2" else model.model.norm
            hidden = norm(hidden)
        torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)


def test_one_forward_serves_every_layer_and_a_rerun_resumes(tiny_run, monkeypatch):
    cfg = tiny_run("cache.dtype=bf16", "cache.shard_mb=0.01", "preinfer.micro_batch=4")
    calls = []
    real = extract_worker.layer_states
    monkeypatch.setattr(extract_worker, "layer_states", lambda *a: calls.append(a[2]) or real(*a))
    res = run_extract(cfg, ExtractConfig(layers=(1, 3), max_rows=50), log=quiet)
    caches = {k: open_cache(cfg.cache.root, fp) for k, fp in res["layers"].items()}
    shards = caches["1"].num_shards
    assert shards > 1 and res["shards"] == shards
    mb = cfg.preinfer.micro_batch
    per_shard = [-(-(b - a) // mb) for a, b in map(caches["1"].shard_range, range(shards))]
    assert calls == [(1, 3)] * sum(per_shard)  # one pass per micro-batch yields both layers
    before = {k: json.loads((c.dir / MANIFEST).read_text())["shards"] for k, c in caches.items()}
    for c in caches.values():
        c.close()

    # a crash after layer 3's shard 1 was lost and before its manifest: the rerun writes only it
    d3 = caches["3"].dir
    (d3 / MANIFEST).unlink()
    (d3 / "done" / "00001.json").unlink()
    calls.clear()
    again = run_extract(cfg, ExtractConfig(layers=(3, 1), max_rows=50), log=quiet)
    assert again["action"] == "extracted" and again["shards"] == 1 and len(calls) == per_shard[1]
    assert json.loads((d3 / MANIFEST).read_text())["shards"] == before["3"]  # the same bytes
    # a crash after every shard's marker and before the manifest: the rerun only finalizes
    (d3 / MANIFEST).unlink()
    calls.clear()
    last = run_extract(cfg, ExtractConfig(layers=(3,), max_rows=50), log=quiet)
    assert last["action"] == "extracted" and last["shards"] == 0 and calls == []
    assert json.loads((d3 / MANIFEST).read_text())["shards"] == before["3"]
    assert run_extract(cfg, ExtractConfig(layers=(1, 3), max_rows=50), log=quiet)["action"] == (
        "reused"
    )
    assert verify_cache(cfg.cache.root, res["layers"]["3"]) == []
    kept = json.loads((Path(cfg.run.dir) / "extracts.json").read_text())  # for `cache gc`
    assert sorted(kept["caches_in_use"]) == sorted(res["layers"].values())


@pytest.mark.slow
@pytest.mark.functional
@pytest.mark.ray
def test_an_extract_over_ray_actors_writes_the_same_bytes_and_resumes(tiny_run, tmp_path):
    """preinfer.executor=ray: two LayerWorker actors share the shards; every layer's cache
    equals the in-process extract's byte for byte (the same shard checksums), and a rerun after
    a lost shard recomputes that shard only, over the actors too."""
    sets = ["cache.dtype=bf16", "cache.shard_mb=0.01", "preinfer.micro_batch=4"]
    local = tiny_run(*sets, f"cache.root={tmp_path / 'local'}", "preinfer.executor=local")
    ray_cfg = tiny_run(*sets, f"cache.root={tmp_path / 'ray'}", "preinfer.executor=ray",
                       "preinfer.actors=2")  # fmt: skip
    ec = ExtractConfig(layers=(1, 3), max_rows=50)
    want = run_extract(local, ec, log=quiet)
    got = run_extract(ray_cfg, ec, log=quiet)
    assert got["layers"] == want["layers"]  # the same identity: the same fingerprints
    assert got["executor"] == "ray" and want["executor"] == "local"
    assert got["shards"] == want["shards"] > 2 and got["rows_computed"] == 50
    for fp in got["layers"].values():
        a = json.loads((Path(local.cache.root) / fp / MANIFEST).read_text())["shards"]
        b = json.loads((Path(ray_cfg.cache.root) / fp / MANIFEST).read_text())["shards"]
        assert a == b and verify_cache(ray_cfg.cache.root, fp) == []
    d3 = Path(ray_cfg.cache.root) / got["layers"]["3"]
    (d3 / MANIFEST).unlink()
    (d3 / "done" / "00002.json").unlink()
    again = run_extract(ray_cfg, ec, log=quiet)
    assert again["action"] == "extracted" and again["shards"] == 1
    m3 = json.loads((Path(local.cache.root) / got["layers"]["3"] / MANIFEST).read_text())
    assert json.loads((d3 / MANIFEST).read_text())["shards"] == m3["shards"]


def test_manifest_records_what_a_reuser_must_match(tiny_run):
    cfg = tiny_run("cache.dtype=bf16", "cache.codec=zstd")
    res = run_extract(cfg, ExtractConfig(layers=(2,), split="val"), log=quiet)
    fp = res["layers"]["2"]
    m = json.loads((Path(cfg.cache.root) / fp / MANIFEST).read_text())
    ident = m["identity"]
    ckpt, store = Checkpoint.open(cfg.run.checkpoint), TokenStore(cfg.data.out_dir)
    assert ident["model"] == model_hash(ckpt) and ident["model_source"] == "random"
    assert ident["tokenizer"] == store.manifest["tokenizer_sha256"]
    assert ident["tokens"] == store.fingerprint and ident["chat_template"] is None
    assert (ident["layer"], ident["split"], ident["rows"]) == (2, "val", store.num_samples("val"))
    assert (ident["dtype"], ident["codec"], ident["seq_len"]) == ("bf16", "zstd", store.seq_len)
    assert (
        ident["format_version"] == m["format_version"]
        and "before the final norm" in (ident["layer_semantics"])
    )
    (row,) = [r for r in list_caches(cfg.cache.root) if r["fingerprint"] == fp]
    assert (row["layer"], row["split"], row["complete"]) == (2, "val", True)
    # the spec a config gives matches the cache it extracted
    open_cache(cfg.cache.root, fp, expect=spec_for(cfg, 2, "val")).close()
    # another layer, split, dtype or max_rows: another cache
    other = run_extract(cfg, ExtractConfig(layers=(2,), max_rows=5), log=quiet)["layers"]["2"]
    assert other != fp


def test_every_reader_refuses_another_identity_in_one_line(tiny_run, tmp_path):
    cfg = tiny_run("cache.dtype=bf16")
    fp = run_extract(cfg, ExtractConfig(layers=(1,), max_rows=20), log=quiet)["layers"]["1"]
    root = cfg.cache.root
    with pytest.raises(IdentityMismatch) as e:
        open_cache(root, fp, expect={"layer": 3, "dtype": "bf16"})
    msg = str(e.value)
    assert "\n" not in msg and "layer: expected 3, found 1" in msg
    assert "preinfer cache extract --layers 3" in msg and "dtype" not in msg
    cache = open_cache(root, fp)
    with pytest.raises(IdentityMismatch, match="model: expected 'abc', found '[0-9a-f]{64}'"):
        CacheDataset(cache, batch_size=4, expect=ExtractSpec(model="abc"))
    with pytest.raises(IdentityMismatch, match="dtype: expected 'fp8_e4m3', found 'bf16'"):
        to_hf_dataset(cache, tmp_path / "hf", expect=ExtractSpec(dtype="fp8_e4m3"))
    assert not (tmp_path / "hf").exists()  # refused before anything was written
    with pytest.raises(CacheError, match="unknown identity field.*'lyer'"):
        open_cache(root, fp, expect={"lyer": 1})
    ok = CacheDataset(cache, batch_size=4, expect={"layer": 1, "model": cache.identity["model"]})
    assert len(ok) == 5
    # a BCD boundary cache records no layer: it is refused too, saying so
    write_small_cache(tmp_path / "c", "ab" * 8)
    with pytest.raises(IdentityMismatch, match=r"layer: expected 1, found None \(not recorded\)"):
        open_cache(tmp_path / "c", "ab" * 8, expect={"layer": 1})
    open_cache(tmp_path / "c", "ab" * 8, expect={"dtype": "bf16", "split": "train"}).close()


def test_cli_extract_and_its_bad_inputs(tiny_run, capsys):
    cfg = tiny_run("cache.dtype=bf16")
    sets = [f"run.dir={cfg.run.dir}", *TINY, "cache.dtype=bf16"]
    argv = ["cache", "extract", "--config", "configs/demo.yaml"]
    argv += [x for o in sets for x in ("--set", o)]
    assert cli.main([*argv, "--layers", "1,2", "--max-rows", "9"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["rows"] == 9 and sorted(out["layers"]) == ["1", "2"]
    for bad, words in (
        (["--layers", "9"], "the model has 4 layers, so a layer id is 0..4"),
        (["--layers", "1,x"], "comma-separated integers"),
        (["--layers", "1", "--max-rows", "0"], "--max-rows 0"),
    ):
        assert cli.main([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("preinfer cache: error:") and words in err and "\n" not in err


def test_cache_gc_keeps_what_an_extract_run_uses(tiny_run, capsys):
    """An extract-only run.dir (extracts.json, no state.json) is a run to `cache gc --run`: its
    caches are kept; a stale cache beside them (no longer in extracts.json) is removed."""
    cfg = tiny_run("cache.dtype=bf16")
    fp = run_extract(cfg, ExtractConfig(layers=(1,), max_rows=9), log=quiet)["layers"]["1"]
    stale = run_extract(cfg, ExtractConfig(layers=(2,), max_rows=9), log=quiet)["layers"]["2"]
    assert not (Path(cfg.run.dir) / "state.json").exists()
    (Path(cfg.run.dir) / "extracts.json").write_text(json.dumps({"caches_in_use": [fp]}))
    sets = [f"run.dir={cfg.run.dir}", f"cache.root={cfg.cache.root}", *TINY, "cache.dtype=bf16"]
    argv = ["cache", "gc", "--config", "configs/demo.yaml", "--run", cfg.run.dir]
    assert cli.main([*argv, *[x for o in sets for x in ("--set", o)]]) == 0
    left = {r["fingerprint"] for r in list_caches(cfg.cache.root)}
    assert fp in left and stale not in left, capsys.readouterr()


def test_manifest_identity_is_checked_against_the_header(tmp_path):
    c = CacheConfig(dtype="bf16", codec="zstd", shuffle="none", shard_mb=1)
    ids = np.zeros((4, 8), int)
    w = CacheWriter.create(tmp_path, "cd" * 8, samples=(np.arange(4), ids, ids), seq_len=8,
                           hidden_size=16, cache_cfg=c, meta={},
                           identity={"kind": "layers", "layer": 3})  # fmt: skip
    w.write_shard(0, torch.zeros(4, 8, 16))
    m = w.finalize()
    assert m["identity"]["dtype"] == "bf16" and m["identity"]["seq_len"] == 8
    with pytest.raises(CacheError, match="another identity.*layer: existing 3, requested 4"):
        CacheWriter.create(tmp_path, "cd" * 8, samples=(np.arange(4), ids, ids), seq_len=8,
                           hidden_size=16, cache_cfg=c, meta={},
                           identity={"kind": "layers", "layer": 4})  # fmt: skip
    with pytest.raises(CacheError, match="identity.layer must be int"):
        CacheWriter.create(tmp_path, "ef" * 8, samples=(np.arange(4), ids, ids), seq_len=8,
                           hidden_size=16, cache_cfg=c, meta={}, identity={"layer": "3"})  # fmt: skip
    p = tmp_path / ("cd" * 8) / MANIFEST
    m["identity"]["dtype"] = "fp32"  # hand-edited: no longer the header's
    p.write_text(json.dumps(m))
    with pytest.raises(CacheCorrupt, match='identity.dtype "fp32" differs from header.dtype'):
        open_cache(tmp_path, "cd" * 8)


def test_fp8_layers_stay_within_the_codecs_bound(tiny_run):
    cfg = tiny_run("cache.dtype=fp32")
    exact = run_extract(cfg, ExtractConfig(layers=(2,), max_rows=30), log=quiet)["layers"]["2"]
    cfg8 = tiny_run("cache.dtype=fp8_e4m3")
    lossy = run_extract(cfg8, ExtractConfig(layers=(2,), max_rows=30), log=quiet)["layers"]["2"]
    a = open_cache(cfg.cache.root, exact).read_rows(0, 30)[0]
    b = open_cache(cfg8.cache.root, lossy, expect={"dtype": "fp8_e4m3"}).read_rows(0, 30)[0]
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of its own magnitude (+ a small floor
    # where the per-token scale maps it near e4m3's smallest normals)
    row_max = a.abs().amax(-1, keepdim=True)
    assert ((a - b).abs() <= a.abs() / 16 + row_max / 448 * 2**-6 + 1e-6).all()
    assert not torch.equal(a, b)


def test_too_little_disk_for_the_layers_is_refused_before_writing(tiny_run, monkeypatch):
    cfg = tiny_run("cache.dtype=bf16")
    monkeypatch.setattr(ex, "free_disk_bytes", lambda root: 10_000)
    with pytest.raises(CacheError, match=r"2 layer\(s\) x 30 rows needs up to .*--max-rows"):
        run_extract(cfg, ExtractConfig(layers=(1, 2), max_rows=30), log=quiet)
    assert not Path(cfg.cache.root).exists() or not any(Path(cfg.cache.root).iterdir())


def test_a_chat_store_records_its_template_and_keeps_its_masks(tmp_path):
    import hashlib

    from pipelines.tokenize import run_tokenize
    from tests.test_chat import CHATML, chat_cfg, save_tokenizer, write_chats

    tok = save_tokenizer(tmp_path / "tok")
    cfg = chat_cfg(tmp_path / "run", write_chats(tmp_path / "c.jsonl", n=40), tok,
                   "cache.dtype=bf16")  # fmt: skip
    run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    fp = run_extract(cfg, ExtractConfig(layers=(1,)), log=quiet)["layers"]["1"]
    c = open_cache(
        cfg.cache.root, fp, expect={"chat_template": hashlib.sha256(CHATML.encode()).hexdigest()}
    )
    _, labels, _ = c.read_rows(0, c.num_samples)
    _, want = TokenStore(cfg.data.out_dir).read_with_labels("train", 0, c.num_samples)
    assert np.array_equal(labels.numpy(), want) and (want == -100).any()  # prompts masked
    with pytest.raises(IdentityMismatch, match="chat_template: expected 'x'"):
        open_cache(cfg.cache.root, fp, expect={"chat_template": "x"})
