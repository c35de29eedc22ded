"""The README's tour runs: its `make` lines, read from README.md, on a tiny corpus and model
(the same commands through the CLI the make targets wrap), ending in a model transformers
loads. The README cannot drift from the code without this failing."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import torch

from pipelines.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.hidden_size=32", "model.num_layers=3", "model.num_heads=2",
        "model.num_kv_heads=1", "model.intermediate_size=64", "model.max_positions=32",
        "model.vocab_size=300", "data.vocab_size=300", "data.seq_len=16",
        "data.val_fraction=0.3", "train.max_steps=3", "train.batch_size=4", "train.eval_batches=1",
        "train.eval_every=0", "cache.shard_mb=0.05"]  # fmt: skip


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
    src = sorted(Path(torch.__file__).parent.glob("nn/modules/*.py"))[:6]  # real text, offline
    for i, f in enumerate(src):
        (corpus / f"doc{i}.txt").write_text(f.read_text())
    mine, makes = tour()
    assert [m.split()[1] for m in makes] == ["tokenize", "init", "plan", "bcd", "eval",
                                              "report", "export"]  # fmt: skip
    subs = {"/data/my_corpus": str(corpus), "runs/": f"{tmp_path}/runs/",
            "data.seq_len=512": "data.seq_len=16", "model.max_positions=512":
            "model.max_positions=32"}  # fmt: skip
    for make in makes:
        assert main(to_cli(make, mine, subs)) == 0, make
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "runs" / "mine-hf"
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.model_type == "llama"
    ids = tok("def forward(self, x):", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()
