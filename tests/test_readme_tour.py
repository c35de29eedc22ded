"""The README's tour runs: its `make` lines, read from README.md, on a tiny corpus and model
(the same commands through the CLI the make targets wrap), ending in a model transformers
loads. The README cannot drift from the code without this failing."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import torch
import yaml

from pipelines.cli import main

ROOT = Path(__file__).resolve().parents[1]
# only the sizes the README leaves to configs/demo.yaml shrink (width, vocab, batch); every
# value the README's lines give (arch, layers, seq_len, rounds, epochs, ...) runs as written
TINY = ["model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "model.vocab_size=300", "data.vocab_size=300",
        "train.batch_size=4", "train.eval_batches=1", "train.eval_every=0",
        "cache.shard_mb=0.05"]  # fmt: skip


def tour() -> tuple[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Five minutes with your own data", 1)[1].split("```bash", 1)[1]
    block = block.split("```", 1)[0]
    mine = re.search(r'^MINE="([^"]*)"', block, re.M).group(1)
    makes = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return mine, [m for m in makes if m.startswith("make ")]


def to_cli(make: str, mine: str, subs: dict[str, str]) -> list[str]:
    """`make T SET="..." [OUT=x]` -> the CLI call the Makefile runs (configs/demo.yaml)."""
    words = shlex.split(make.replace("$MINE", mine))
    target, rest = words[1], words[2:]
    sets, out = [], None
    for w in rest:
        key, _, val = w.partition("=")
        if key == "SET":
            sets += val.split()
        elif key == "OUT":
            out = val
    sets = [subs.get(s, s) for s in sets]
    for a, b in subs.items():
        sets = [s.replace(a, b) for s in sets]
        out = out and out.replace(a, b)
    cmd = {"tokenize": ["tokenize"], "init": ["init"], "plan": ["plan"], "bcd": ["bcd"],
           "eval": ["eval"], "report": ["report"], "export": ["export", "--out", str(out)]}  # fmt: skip
    args = [*cmd[target], "--config", str(ROOT / "configs/demo.yaml")]
    for s in [*sets, *TINY]:
        args += ["--set", s]
    return args


def test_readme_tour_runs_from_your_own_data_to_a_transformers_model(tmp_path):
    corpus = tmp_path / "my_corpus"
    corpus.mkdir()
    # real text, offline: 40 documents (demo.yaml holds 5% out for val) of 800 characters,
    # some 20 rows of the README's 512 tokens
    texts = [f.read_text() for f in sorted(Path(torch.__file__).parent.glob("nn/**/*.py"))]
    for i, text in enumerate([t for t in texts if len(t) >= 800][:40]):
        (corpus / f"doc{i}.txt").write_text(text[:800])
    mine, makes = tour()
    assert [m.split()[1] for m in makes] == ["tokenize", "init", "plan", "bcd", "eval",
                                              "report", "export"]  # fmt: skip
    subs = {"/data/my_corpus": str(corpus), "runs/": f"{tmp_path}/runs/"}
    for make in makes:
        assert main(to_cli(make, mine, subs)) == 0, make
    # what ran is what the README says (config.json: the run's resolved settings)
    ran = json.loads((tmp_path / "runs" / "mine" / "config.json").read_text())
    bcd = next(m for m in makes if m.split()[1] == "bcd")
    extra = shlex.split(bcd.replace("$MINE", ""))[2].partition("=")[2].split()
    said = dict(s.split("=", 1) for s in mine.split() + extra)
    assert {"train.rounds", "model.num_layers", "data.seq_len"} <= set(said)
    # the path runs the recommended settings without flags (#42): head in every visit, each
    # visit its own rows, an untied head
    assert ran["train"]["always_train"] == ["head"]
    assert ran["train"]["cache_visits"] == ran["partition"]["num_blocks"]
    assert ran["model"]["tie_embeddings"] is False
    for key, want in said.items():
        section, name = key.split(".")
        if section != "run":
            want = yaml.safe_load(want.replace("/data/my_corpus", str(corpus)))
            assert ran[section][name] == want, key
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "runs" / "mine-hf"
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.model_type == "llama"
    ids = tok("def forward(self, x):", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()
