"""Export a checkpoint as a Hugging Face transformers directory (what `preinfer export` writes).

    <out>/
      config.json               the HF config (architectures, model_type, tie_word_embeddings)
      model.safetensors         every weight, tied aliases stored once (transformers' own rule)
      generation_config.json    causal LMs only: bos / eos / pad token ids
      tokenizer.json            the token store's tokenizer (padding/truncation off)
      tokenizer_config.json     its special tokens, model_max_length

A causal LM fine-tuned from the user's own HF directory (`hf_tokenizer`: the data.tokenizer
directory, with its tokenizer_config.json; `hf_model`: the model.checkpoint directory) keeps
what came in: the tokenizer files are copied as they are (tokenizer.json, tokenizer_config.json,
the chat template, ...: so its special tokens, their ids and model_max_length are the user's),
config.json carries the input config.json's bos / eos / pad ids, and generation_config.json is
the input's (training changes none of its values). Only preinfer's own tokenizer (a trained BPE,
or a bare tokenizer.json) gets the special tokens above, looked up by name.

It loads with `AutoModelForCausalLM.from_pretrained(out)` (gpt2, llama, mistral, qwen2) or
`AutoModelForMaskedLM` (bert), and `AutoTokenizer.from_pretrained(out)`.

      .preinfer-export.json     the marker: what was exported (checkpoint, run) and when

The directory is written into a hidden sibling (`.<name>.export-<id>.partial`) and renamed into
place at the end, so `out` never holds a half-written export; an error (a full disk included:
an OSError naming the file) removes the sibling (and the parent directories it made). Its files
get the modes the user's umask gives. A non-empty `out` is replaced only with force=True, and
only when it is a previous export (it holds the marker; the old one is moved aside, then
deleted): anything else is refused, force or not. An `out` that is, holds or lies inside a
directory of the run (`owned`: run.dir, the token store, the checkpoint, the cache root) is
refused too. Everything is read and checked (block hashes, the tokenizer) before anything is
written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from core.config import ConfigError
from preinfer.checkpoint.format import CheckpointError
from preinfer.checkpoint.store import Checkpoint
from preinfer.data.tokenization import SPECIAL_EOS, load_tokenizer
from preinfer.model.modeling import quiet_transformers
from storage import fs
from storage.atomic import as_os_error, replace_dir

# Special tokens looked up by name in the tokenizer's vocabulary (first present wins).
_EOS = tuple(t for t in SPECIAL_EOS if t != "[SEP]") + ("<|end_of_text|>",)
_BOS = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>")
_PAD = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
_UNK = ("<unk>", "[UNK]", "<|unk|>")
_MASKED = {"cls_token": ("[CLS]", "<s>"), "sep_token": ("[SEP]", "</s>"),
           "mask_token": ("[MASK]", "<mask>")}  # fmt: skip
# The tokenizer files of an HF directory that an export copies as they are (those present).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "added_tokens.json", "chat_template.jinja", "chat_template.json",
                      "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model")  # fmt: skip
_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
MARKER = ".preinfer-export.json"  # in every export: what --force may replace


def auto_class(arch: str) -> str:
    """The transformers Auto class that loads an export of `arch`."""
    return "AutoModelForMaskedLM" if arch == "bert" else "AutoModelForCausalLM"


def check_out_dir(out: str | Path, force: bool, owned: dict[str, str] | None = None,
                  free: str | Path | None = None) -> Path:  # fmt: skip
    """`out` as a local Path, refusing an object-store URL, a file, one that is, holds or lies
    inside a directory of `owned` ({config key: path}; symlinks and `..` resolved; `free`: a
    path inside them that an export may take, the demo's own), and a non-empty directory
    unless force is given and it is a previous export (holds MARKER)."""
    if fs.is_url(out):
        raise ConfigError(
            f"export --out {out}: an export is a local directory; give a local path "
            "(then upload the directory if you need it on the object store)"
        )
    p = Path(out).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"export --out {p} is a file, not a directory; choose another path")
    above = next((a for a in p.parents if a.exists()), None)  # the nearest existing parent
    if above is not None and not above.is_dir():
        raise ConfigError(
            f"export --out {p}: its parent {above} is a file, not a directory; choose another path"
        )
    _check_not_owned(p, owned or {}, free)
    if p.is_dir() and any(p.iterdir()):
        if not force:
            raise ConfigError(
                f"export --out {p} exists and is not empty; pass --force to replace it (a "
                "previous export only) or choose another directory"
            )
        if not (p / MARKER).is_file():
            raise ConfigError(
                f"export --out {p} is not a preinfer export (it has no {MARKER}), so --force "
                "does not replace it; nothing was touched. Choose another directory, or empty "
                "that one yourself if nothing in it is needed"
            )
    return p


def _check_not_owned(p: Path, owned: dict[str, str], free: str | Path | None) -> None:
    """Refuse an export path that is, holds or lies inside one of the run's directories: its
    replace would delete them, or mix an export into them. Named by the most specific key."""
    real = Path(os.path.realpath(p))
    dirs = {k: Path(os.path.realpath(v)) for k, v in owned.items() if v and not fs.is_url(v)}
    if free is not None and real == Path(os.path.realpath(free)):
        dirs = {k: d for k, d in dirs.items() if d not in real.parents}  # inside run.dir only
    clash = next(((k, d, "is") for k, d in dirs.items() if real == d), None)
    clash = clash or next(((k, d, "lies inside") for k, d in dirs.items() if d in real.parents),
                          None)  # fmt: skip
    clash = clash or next(((k, d, "holds") for k, d in reversed(dirs.items())
                           if real in d.parents), None)  # fmt: skip
    if clash is not None:
        key, d, how = clash
        raise ConfigError(
            f"export --out {p} {how} {key} {d}: an export there would replace or mix with the "
            f"run's own files, so it is refused with or without --force; nothing was touched. "
            f"Choose a directory outside {', '.join(owned)}"
            + (f" (or {free}, the run's own export directory)" if free is not None else "")
        )


def read_tokenizer(path: str | Path, vocab_size: int):
    """The `tokenizers.Tokenizer` in `path` (a token store's tokenizer.json, local or URL), with
    padding and truncation off (ids exactly as the token store has them)."""
    from tokenizers import Tokenizer

    p = fs.path(path)
    if not p.is_file():
        raise ConfigError(
            f"no tokenizer at {p}: the token store (data.out_dir) holds none; run "
            "`preinfer tokenize` with this config first, or point data.out_dir at the token "
            "store the checkpoint was trained on"
        )
    try:
        tok = Tokenizer.from_str(p.read_text())
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ConfigError(
            f"the tokenizer {p} is unreadable ({e}); re-create the token store with "
            "`preinfer tokenize --force`"
        ) from None
    tok.no_padding()
    tok.no_truncation()
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ConfigError(
            f"the tokenizer {p} has {n} tokens but the checkpoint's embedding has {vocab_size} "
            "rows: it is not this model's tokenizer; point data.out_dir at the token store the "
            "checkpoint was trained on"
        )
    return tok


def special_tokens(tok, arch: str) -> dict[str, str]:
    """Special-token roles for the HF tokenizer, from the tokens the vocabulary has. Causal LMs:
    eos (the end-of-document token the store packs between documents), bos (a dedicated one,
    else eos, as GPT-2 does), pad (a dedicated one, else eos), unk. BERT: cls, sep, mask, pad,
    unk (as BERT's own tokenizer has them)."""
    vocab = tok.get_vocab(with_added_tokens=True)

    def first(names):
        return next((n for n in names if n in vocab), None)

    roles = {"unk_token": first(_UNK), "pad_token": first(_PAD)}
    if arch == "bert":
        roles.update({role: first(names) for role, names in _MASKED.items()})
    else:
        roles["eos_token"] = first(_EOS)
        roles["bos_token"] = first(_BOS) or roles["eos_token"]
        roles["pad_token"] = roles["pad_token"] or roles["eos_token"]
    return {k: v for k, v in roles.items() if v is not None}


def user_tokenizer(hf_dir: Path | None, tok, tokenizer_path) -> dict | None:
    """The user's HF tokenizer directory `hf_dir` (data.tokenizer) where it holds a
    tokenizer_config.json, else None (preinfer's own tokenizer): {"files": the
    HF_TOKENIZER_FILES it has, "roles": its special tokens (bos / eos / pad / unk as its
    tokenizer_config has them), "ids": their ids}. Refuses one whose tokenizer.json is no longer
    the token store's `tok` (read from `tokenizer_path`)."""
    from transformers import AutoTokenizer

    if hf_dir is None or not (Path(hf_dir) / "tokenizer_config.json").is_file():
        return None
    hf_dir = Path(hf_dir)
    try:
        theirs = load_tokenizer(hf_dir / "tokenizer.json").to_str()
    except Exception:  # missing or malformed: tokenizers raises a bare Exception
        theirs = None
    if theirs != tok.to_str():  # both with padding/truncation off, as the store encodes
        raise ConfigError(
            f"data.tokenizer {hf_dir}: its tokenizer.json is not the one the token store "
            f"({tokenizer_path}) was made with; restore it, or remake the store with "
            "`preinfer tokenize --force` and train again"
        )
    try:
        hf = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    except Exception as e:  # transformers raises many kinds for an unloadable directory
        raise ConfigError(f"data.tokenizer {hf_dir}: transformers cannot load it ({e})") from None
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    roles = {r: str(getattr(hf, r)) for r in names if getattr(hf, r) is not None}
    return {
        "files": [hf_dir / n for n in HF_TOKENIZER_FILES if (hf_dir / n).is_file()],
        "roles": roles,
        "ids": {r: hf.convert_tokens_to_ids(t) for r, t in roles.items()},
    }


def _keep_user_ids(model, ids: dict, hf_model: Path | None) -> None:
    """config.json and generation_config.json as the user's model directory `hf_model` had them:
    its config.json's bos / eos / pad ids (its pad too: the user's model has that padding_idx
    already), its generation_config.json as it is (training changes none of its values). What
    it does not say comes from the user's tokenizer (`ids`: role -> id; no pad in config.json,
    see export_hf)."""
    from transformers import GenerationConfig

    given = json.loads((hf_model / "config.json").read_text()) if hf_model is not None else {}
    for key in _ID_KEYS:
        if key in given:
            setattr(model.config, key, given[key])
        elif key != "pad_token_id":
            setattr(model.config, key, ids.get(key.removesuffix("_id")))
    if hf_model is not None and (hf_model / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(hf_model)
    else:
        model.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=given.get("pad_token_id", ids.get("pad_token")),
        )


def _load_full(ckpt: Checkpoint):
    """Every block, read and hash-checked; the transformers model in fp32 on CPU."""
    arch = ckpt.index["arch"]
    if arch == "sequential" or ckpt.hf_config is None:
        raise ConfigError(
            f"checkpoint {ckpt.path} is a model.arch={arch!r} model, preinfer's own "
            "nn.Sequential that transformers has no class for; export supports gpt2, llama "
            "(mistral, qwen2) and bert"
        )
    model, _ = ckpt.load(range(ckpt.num_blocks), device="cpu")
    on_meta = [n for n, t in model.state_dict().items() if t.is_meta]
    if on_meta:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: tensors {on_meta[:3]} are in no block file; the checkpoint "
            "is incomplete; re-create it with `preinfer init --force`"
        )
    return model


def _fsync_tree(root: Path) -> None:
    for f in root.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _user_modes(root: Path) -> None:
    """Files as the user's umask makes them (what `root`, made by mkdir, got, less execute):
    some writers (safetensors) create theirs 0600."""
    mode = root.stat().st_mode & 0o666
    for f in root.iterdir():
        if f.is_file():
            f.chmod(mode)


def _move_into_place(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished `tmp` to `out`; an existing `out` (empty, or a previous export with
    force) is replaced (storage.atomic.replace_dir: put back if the rename fails)."""
    if out.exists():
        check_out_dir(out, force)  # it may have filled up while we wrote
    replace_dir(tmp, out)


def _os_errors(name: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), with the I/O error of a Rust writer (safetensors, tokenizers: a
    plain Exception ending in `(os error N)`) raised as the OSError naming file `name`."""
    try:
        return fn(*args, **kwargs)
    except OSError:
        raise
    except Exception as e:
        err = as_os_error(e, name)
        if err is None:
            raise
        raise err from e


def export_hf(ckpt: Checkpoint, tokenizer_path: str | Path, out: str | Path, *,
              force: bool = False, hf_tokenizer: Path | None = None,
              hf_model: Path | None = None, owned: dict[str, str] | None = None,
              free: str | Path | None = None, source: dict | None = None) -> dict:  # fmt: skip
    """Write `ckpt` (all blocks, as they are now) and the tokenizer at `tokenizer_path` as a
    transformers directory at `out` (see the module docstring). `hf_tokenizer` / `hf_model`: the
    user's HF directories the run started from (data.tokenizer, model.checkpoint; None: none),
    whose tokens, chat template and generation config a causal LM's export keeps. `owned`,
    `free`: as check_out_dir; `source`: more for the marker (the run.dir). Returns what was
    written."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out = check_out_dir(out, force, owned, free)
    arch = ckpt.index["arch"]
    causal = arch != "bert"
    tok = read_tokenizer(tokenizer_path, ckpt.vocab_size)
    kept = user_tokenizer(hf_tokenizer, tok, tokenizer_path) if causal else None
    if kept is not None:
        roles, ids = kept["roles"], kept["ids"]
    else:
        roles = special_tokens(tok, arch)
        ids = {role: tok.token_to_id(name) for role, name in roles.items()}
    model = _load_full(ckpt)
    if kept is not None:
        _keep_user_ids(model, ids, hf_model)
    elif causal:
        if "eos_token" not in roles:
            raise ConfigError(
                f"the tokenizer {tokenizer_path} has none of the end-of-document tokens "
                f"{', '.join(_EOS)}; a causal LM export needs one to stop generation"
            )
        # config.json gets bos/eos only: a pad id there becomes the embedding's padding_idx
        # in some families (llama), which would freeze the eos row when fine-tuning
        model.config.bos_token_id = ids["bos_token"]
        model.config.eos_token_id = ids["eos_token"]
        model.generation_config = GenerationConfig(
            bos_token_id=ids["bos_token"],
            eos_token_id=ids["eos_token"],
            pad_token_id=ids["pad_token"],
        )
    hf_tok = None
    if kept is None:
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            model_max_length=ckpt.max_positions or int(1e30),
            **roles,
        )

    made = [a for a in (out.parent, *out.parent.parents) if not a.exists()]  # deepest first
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{uuid.uuid4().hex[:8]}.partial")
    try:
        tmp.mkdir()
        with quiet_transformers(progress_bars=False):  # a full disk: an OSError naming the file
            _os_errors(out / "model.safetensors", model.save_pretrained, tmp,
                       safe_serialization=True)  # fmt: skip
            if causal and not (tmp / "generation_config.json").is_file():
                model.generation_config.save_pretrained(tmp)
            if kept is None:
                _os_errors(out / "tokenizer.json", hf_tok.save_pretrained, tmp)
        for f in kept["files"] if kept is not None else ():
            shutil.copyfile(f, tmp / f.name)  # as they came: training changed none of them
        marker = {"preinfer_export": 1, **(source or {}), "checkpoint": str(ckpt.path),
                  "checkpoint_hash": ckpt.prefix_hash(ckpt.num_blocks), "arch": arch,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _user_modes(tmp)
        _fsync_tree(tmp)
        files = sorted(f.name for f in tmp.iterdir())
        _move_into_place(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for a in made:  # the directories this export made, if still empty
            with contextlib.suppress(OSError):
                a.rmdir()
        raise
    return {
        "out": str(out),
        "arch": arch,
        "model_class": type(model).__name__,
        "auto_class": auto_class(arch),
        "num_params": sum(p.numel() for p in model.parameters()),
        "tied": bool(ckpt.tied),
        "special_tokens": roles,
        "tokenizer_from": str(hf_tokenizer) if kept is not None else None,
        "files": files,
        "checkpoint": ckpt.prefix_hash(ckpt.num_blocks),
    }
