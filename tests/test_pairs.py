"""Instruction data (data.format=prompt_response): exact label masks, pairs packed whole (or
split with data.split_pairs), a loss over the response tokens only (hand-checked), response-only
eval, and a step from the cache equal to one with the prefix recomputed."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from core.config import ConfigError
from pipelines.cache_build import build_cache, plan_block
from pipelines.eval import run_eval
from pipelines.tokenize import run_tokenize
from preinfer.checkpoint.store import Checkpoint
from preinfer.data.tokenization import is_val, iter_documents, load_tokenizer
from preinfer.model.adapters import forward_blocks
from preinfer.model.evaluation import evaluate_tokens
from preinfer.model.loss import IGNORE
from preinfer.run.visit import Visit, VisitSpec
from storage.reader import open_cache
from storage.tokens import TokenStore
from tests.pipeline_fixtures import quiet, tiny_cfg

S = 48
TEMPLATE = "### Instruction:\n{instruction}\n{input}\n### Response:\n"


def write_alpaca(path):
    """An alpaca-shaped jsonl: instruction / input (often empty) / output; a few pairs too long
    for S+1 tokens."""
    rows = []
    for i in range(90):
        out = f"{i} plus {i % 7} is {i + i % 7}."
        if i % 23 == 5:
            out += " That is the sum, written out in many words." * 6
        rows.append(
            {"instruction": f"Add {i} and {i % 7}.", "input": "" if i % 3 else f"({i})",
             "output": out}
        )  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def pairs_cfg(run_dir, source, *extra):
    cfg = tiny_cfg(
        run_dir,
        f"data.source={source}",
        "data.format=prompt_response",
        "data.response_field=output",
        "data.max_documents=1000",
        f"data.seq_len={S}",
        "data.val_fraction=0.2",
        "train.batch_size=4",
        *extra,
    )
    cfg.data = dataclasses.replace(cfg.data, prompt_template=TEMPLATE)
    return cfg


@pytest.fixture(scope="session")
def pairs_base(tmp_path_factory):
    from pipelines.init import run_init

    base = tmp_path_factory.mktemp("pairs_base")
    src = write_alpaca(base / "alpaca.jsonl")
    said = []
    cfg = pairs_cfg(base / "run", src)
    run_tokenize(cfg, log=said.append)
    run_init(cfg, log=quiet)
    return base, said


@pytest.fixture
def pairs_run(pairs_base, tmp_path):
    base, _ = pairs_base
    shutil.copytree(base, tmp_path / "base")
    src = base / "alpaca.jsonl"  # the source the store was made from: stages refuse another
    return lambda *extra: pairs_cfg(tmp_path / "base" / "run", src, *extra)


def reference_rows(cfg, split, tok, eos):
    """The rows the rule gives, built the plain way: (ids (n, S+1), labels (n, S), dropped)."""
    n = cfg.data.seq_len + 1
    rows, cur, dropped, stream = [], [], 0, []
    for doc in iter_documents(cfg.data):
        if is_val(doc, cfg.data) != (split == "val"):
            continue
        p = tok.encode(doc.text, add_special_tokens=False).ids
        r = tok.encode(doc.response, add_special_tokens=False).ids
        pair = [(t, False) for t in p] + [(t, True) for t in [*r, eos]]
        if cfg.data.split_pairs:
            stream += pair
            continue
        if len(pair) > n:
            dropped += 1
            continue
        if len(cur) + len(pair) > n:
            rows.append(cur + [(eos, False)] * (n - len(cur)))
            cur = []
        cur += pair
    if cfg.data.split_pairs:
        rows = [stream[i : i + n] for i in range(0, len(stream) - n + 1, n)]
        cur = stream[len(rows) * n :]
    if cur:
        rows.append(cur + [(eos, False)] * (n - len(cur)))
    rows = [r for r in rows if any(t for _, t in r[1:])]
    ids = np.array([[t for t, _ in r] for r in rows], np.int32)
    labels = np.array([[t if m else IGNORE for t, m in r[1:]] for r in rows], np.int32)
    return ids, labels, dropped


@pytest.mark.parametrize("split_pairs", [False, True])
def test_labels_mask_the_prompt_exactly(tmp_path, split_pairs):
    src = write_alpaca(tmp_path / "alpaca.jsonl")
    said = []
    cfg = pairs_cfg(tmp_path / "run", src, f"data.split_pairs={split_pairs}")
    store = run_tokenize(cfg, log=said.append)
    assert store.has_labels and store.manifest["format_version"] == 2
    tok, eos = load_tokenizer(store.tokenizer_path), store.manifest["eos_id"]
    for split in ("train", "val"):
        ids, labels = store.read_with_labels(split, 0, store.num_samples(split))
        want_ids, want_labels, dropped = reference_rows(cfg, split, tok, eos)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(labels, want_labels)
        assert store.manifest["pairs"][split]["dropped_too_long"] == dropped
        if not split_pairs:
            # whole pairs: what counts in a row is its responses, each ended by EOS
            text = tok.decode([t for t in labels[0] if t != IGNORE], skip_special_tokens=False)
            assert text.endswith(".<|endoftext|>") and "Instruction" not in text
            assert "plus" in text and text.count("<|endoftext|>") >= 1
    stats = store.manifest["pairs"]["train"]
    if split_pairs:
        assert stats["dropped_too_long"] == 0
    else:
        assert stats["dropped_too_long"] > 0
        assert any(f"dropped {stats['dropped_too_long']} of" in m for m in said)


def test_loss_counts_response_tokens_only(pairs_run):
    cfg = pairs_run("train.eval_every=0")
    visit = Visit(cfg, VisitSpec(block=0, mode="bcd", shuffle=False), device=torch.device("cpu"))
    x, labels = next(iter(visit.batches.epoch(0)))
    store = visit.store
    rows = visit.batches.rows[:4]  # unshuffled: the visit's first rows (a round's row order)
    stored = np.concatenate([store.read_with_labels("train", i, i + 1)[1] for i in rows])
    np.testing.assert_array_equal(labels.numpy(), stored)
    mask = labels != IGNORE
    assert mask.any() and (~mask).sum() > mask.sum() // 4  # prompts and padding are masked
    with torch.no_grad():
        loss = visit.loss(x, labels)
        logits = forward_blocks(visit.adapter, visit.part, x, 0, visit.M).double()
    nll = -torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    hand = nll[mask].sum() / mask.sum()  # mean over the response tokens (and their EOS)
    torch.testing.assert_close(loss.double(), hand, rtol=1e-5, atol=1e-6)
    assert abs(nll.mean() - hand) > 1e-3  # every position would give another number

    # eval: the same, over the val split (response tokens only)
    res = evaluate_tokens(
        lambda ids: forward_blocks(visit.adapter, visit.part, ids, 0, visit.M), store,
        split="val", batch_size=3,
    )  # fmt: skip
    ids, lab = store.read_with_labels("val", 0, store.num_samples("val"))
    with torch.no_grad():
        logits = forward_blocks(
            visit.adapter, visit.part, torch.from_numpy(ids[:, :-1]).long(), 0, visit.M
        ).double()
    lab = torch.from_numpy(lab).long()
    m = lab != IGNORE
    nll = -torch.log_softmax(logits, -1).gather(-1, lab.clamp_min(0)[..., None])[..., 0]
    assert res["tokens"] == int(m.sum())
    assert res["loss"] == pytest.approx(float(nll[m].mean()), rel=1e-5)
    out = run_eval(cfg, log=quiet)
    assert out["targets"] == "response" and out["loss"] == pytest.approx(res["loss"], rel=1e-5)


def test_step_from_cache_equals_step_with_prefix_recomputed(pairs_run, tmp_path):
    over = ["train.max_steps=1", "train.eval_every=0", "train.warmup_steps=0"]
    cached = pairs_run(*over)
    fps = build_cache(cached, 1, log=quiet)["fingerprints"]
    # the cache's labels are the store's, masks included, row for row
    plan = {p.split: p for p in plan_block(cached, 1).caches}
    tokens = TokenStore(cached.data.out_dir)
    for split in ("train", "val"):
        cache = open_cache(cached.cache.root, fps[split], expected_fingerprint=fps[split])
        got = cache.read_labels(0, cache.num_samples)[0].numpy()
        idx = plan[split].indices
        _, want = tokens.read_indices_with_labels(split, np.sort(idx))
        want = want[np.argsort(np.argsort(idx))]  # back into the cache's row order
        np.testing.assert_array_equal(got, want)
        assert (got == IGNORE).any()

    ckpt = Checkpoint.open(cached.run.checkpoint)
    model, adapter = ckpt.load([1])
    before = {k: v.clone() for k, v in ckpt.block_state(model, adapter, 1).items()}
    spec = VisitSpec(block=1, mode="bcd", shuffle=False, cache_train=fps["train"],
                     cache_val=fps["val"])  # fmt: skip
    Visit(cached, spec, device=torch.device("cpu")).run(log=quiet)
    model, adapter = Checkpoint.open(cached.run.checkpoint).load([1])
    after_cached = Checkpoint.open(cached.run.checkpoint).block_state(model, adapter, 1)

    other = tmp_path / "recompute"
    shutil.copytree(cached.run.dir, other, ignore=shutil.ignore_patterns("cache", "*.jsonl"))
    recompute = pairs_run(*over, f"run.dir={other}")
    Checkpoint.open(recompute.run.checkpoint).commit_block(1, before)
    spec = VisitSpec(block=1, mode="bcd-recompute", shuffle=False)
    Visit(recompute, spec, device=torch.device("cpu")).run(log=quiet)
    ck = Checkpoint.open(recompute.run.checkpoint)
    model, adapter = ck.load([1])
    after_recompute = ck.block_state(model, adapter, 1)
    changed = 0
    for name, t in after_cached.items():
        torch.testing.assert_close(t, after_recompute[name], rtol=1e-5, atol=1e-7)
        changed += not torch.equal(t, before[name])
    assert changed > 0, "the step changed nothing"


def test_masked_positions_get_no_gradient():
    # a position whose label is IGNORE contributes nothing: changing its logits changes nothing
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, :3] = IGNORE
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE).backward()
    assert torch.count_nonzero(logits.grad[0, :3]) == 0 and logits.grad[0, 3:].abs().sum() > 0


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["data.source=builtin"], "holds documents, not prompt/response rows"),
        (["data.response_field=answer"], r"data.response_field: column 'answer' not in"),
    ],
)
def test_bad_pair_inputs_are_clear_errors_and_write_nothing(tmp_path, extra, needle):
    src = write_alpaca(tmp_path / "alpaca.jsonl")
    with pytest.raises(ConfigError, match=needle):
        run_tokenize(pairs_cfg(tmp_path / "run", src, *extra), log=quiet)
    assert not (tmp_path / "run" / "tokens").exists()


def test_bad_template_and_text_files_are_clear_errors(tmp_path):
    from preinfer.data.config import DataConfig

    with pytest.raises(ConfigError, match="prompt_template is not a valid template"):
        DataConfig(format="prompt_response", prompt_template="{instruction")
    with pytest.raises(ConfigError, match="must name columns"):
        DataConfig(format="prompt_response", prompt_template="{} then {0}")
    (tmp_path / "a.txt").write_text("some text " * 50)
    with pytest.raises(ConfigError, match="is a text file"):
        run_tokenize(pairs_cfg(tmp_path / "run", tmp_path / "a.txt"), log=quiet)
