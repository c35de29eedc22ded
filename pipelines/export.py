"""Stage `preinfer export`: the checkpoint as it is now, plus the token store's tokenizer, as a
Hugging Face transformers directory (config.json, model.safetensors, tokenizer files and, for
causal LMs, generation_config.json). The writing is preinfer/export.py's."""

from __future__ import annotations

from preinfer.checkpoint import Checkpoint
from preinfer.config import Config
from preinfer.export import check_out_dir, export_hf
from storage import fs


def run_export(cfg: Config, out: str, force: bool = False, log=print) -> dict:
    check_out_dir(out, force)  # before reading anything
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    res = export_hf(ckpt, fs.path(cfg.data.out_dir) / "tokenizer.json", out, force=force)
    log(
        f"export: {res['out']}: {res['model_class']} ({res['num_params']:,} params) + tokenizer; "
        f"load it with transformers.{res['auto_class']}.from_pretrained and "
        "AutoTokenizer.from_pretrained"
    )
    return res
