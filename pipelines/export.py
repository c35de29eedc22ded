"""Stage `preinfer export`: the checkpoint as it is now, plus the token store's tokenizer, as a
Hugging Face transformers directory (config.json, model.safetensors, tokenizer files and, for
causal LMs, generation_config.json). A causal LM fine-tuned from the user's HF directories
(data.tokenizer, model.checkpoint) keeps their tokenizer files, special-token ids and generation
config. The writing is preinfer/checkpoint/export.py's.

`--out` never is, holds or lies inside a directory of the run (run.dir, data.out_dir,
run.checkpoint, cache.root), with or without --force, except `<run.dir>/export` (RUN_EXPORT:
where the demo writes its export); --force replaces a previous export only (one holding the
marker file every export gets)."""

from __future__ import annotations

from preinfer.checkpoint.export import check_out_dir, export_hf
from preinfer.checkpoint.store import Checkpoint
from preinfer.data.tokenization import tokenizer_file
from preinfer.model.modeling import resolve_checkpoint_path, resolve_package_path
from preinfer.run.config import Config
from preinfer.run.provenance import check_settings
from preinfer.run.state import check_run
from storage import fs
from storage.tokens import TokenStore

RUN_EXPORT = "export"  # the one directory inside run.dir an export may take (the demo's)


def owned_dirs(cfg: Config) -> dict[str, str]:
    """The run's directories an export must stay out of, most specific first."""
    return {"run.checkpoint": cfg.run.checkpoint, "data.out_dir": cfg.data.out_dir,
            "cache.root": cfg.cache.root, "run.dir": cfg.run.dir}  # fmt: skip


def run_export(cfg: Config, out: str, force: bool = False, log=print) -> dict:
    owned, free = owned_dirs(cfg), f"{cfg.run.dir}/{RUN_EXPORT}"
    check_out_dir(out, force, owned, free)  # before reading anything
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    tokens = TokenStore(cfg.data.out_dir).manifest if TokenStore.exists(cfg.data.out_dir) else None
    check_settings(cfg, "export", tokens=tokens, checkpoint=ckpt.index)
    state = check_run(cfg.run.dir, ckpt, "export")
    hf_tokenizer = hf_model = None  # the user's HF directories: a causal LM's export keeps them
    if cfg.model.arch != "bert":
        if cfg.data.tokenizer != "bpe":
            tokenizer_file(cfg.data.tokenizer)  # refuses a data.tokenizer that is gone
            given = resolve_package_path(cfg.data.tokenizer, "data.tokenizer")
            hf_tokenizer = given if given.is_dir() else None
        if cfg.model.checkpoint is not None:
            hf_model = resolve_checkpoint_path(cfg.model.checkpoint)
    res = export_hf(ckpt, fs.path(cfg.data.out_dir) / "tokenizer.json", out, force=force,
                    hf_tokenizer=hf_tokenizer, hf_model=hf_model, owned=owned, free=free,
                    source={"run_dir": cfg.run.dir})  # fmt: skip
    log(
        f"export: {res['out']}: {res['model_class']} ({res['num_params']:,} params) + tokenizer; "
        f"load it with transformers.{res['auto_class']}.from_pretrained and "
        "AutoTokenizer.from_pretrained"
    )
    if ckpt.trained_tokens is None and not state.get("visits"):
        log(f"export: note: {ckpt.path} has not been trained (as `preinfer init` wrote it): "
            "this export is the initial model; run `preinfer bcd` first to export a trained "
            "one")  # fmt: skip
    return res
