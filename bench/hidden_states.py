"""Real hidden states for the cache codec benchmark: .npy float32 [N, S, H] at a block boundary.

    python -m bench.hidden_states [--model minilm gpt2] [--samples 256] [--docs 40]
                                  [--boundary K] [--out /tmp/preinfer_hidden]

minilm: the pretrained MiniLM-L6 (configs/minilm.yaml, its own WordPiece tokenizer) over the
built-in corpus; gpt2: the randomly initialised GPT-2 layout of configs/demo.yaml. Each runs
the project's own stages (tokenize, init) in a run directory under --out and computes the
hidden state entering block K in float32 (default K = ceil(M / 2), a middle boundary).
Outputs `<out>/<model>_d<docs>_s<S>_n<samples>_k<K|mid>.npy` (N may be below --samples if the
corpus is short) and a .json beside it; an existing output is reused (delete it to recompute).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import ROOT, quiet
from storage.atomic import write_file, write_json

CONFIGS = {"minilm": "configs/minilm.yaml", "gpt2": "configs/demo.yaml"}
DEFAULT_OUT = Path("/tmp/preinfer_hidden")


def generate(model: str, out: Path = DEFAULT_OUT, *, samples: int = 256, docs: int = 40,
             seq_len: int = 128, boundary: int | None = None, log=print) -> Path:  # fmt: skip
    """Path of the .npy of `model`'s hidden states (computed unless already there)."""
    from pipelines.init import run_init
    from pipelines.tokenize import run_tokenize
    from preinfer.checkpoint.store import Checkpoint
    from preinfer.model.adapters import forward_blocks
    from preinfer.run.config import load_config

    out = Path(out)
    tag = f"{model}_d{docs}_s{seq_len}_n{samples}_k{'mid' if boundary is None else boundary}"
    path = out / f"{tag}.npy"
    if path.exists():
        return path
    over = [f"run.dir={out / f'run_{model}_d{docs}_s{seq_len}'}", f"data.max_documents={docs}",
            f"data.seq_len={seq_len}"]  # fmt: skip
    cfg = load_config(ROOT / CONFIGS[model], over)
    store = run_tokenize(cfg, log=quiet)
    run_init(cfg, log=quiet)
    ckpt = Checkpoint.open(cfg.run.checkpoint)
    m = ckpt.num_blocks
    k = (m + 1) // 2 if boundary is None else boundary
    if not 1 <= k < m:
        raise SystemExit(f"--boundary must be in 1..{m - 1} (the model has {m} blocks)")
    n = min(samples, store.num_samples("train"))
    t0 = time.perf_counter()
    net, adapter = ckpt.load(range(k))
    ids = torch.from_numpy(store.read("train", 0, n)[:, :seq_len].astype(np.int64))
    with torch.inference_mode():
        parts = [forward_blocks(adapter, ckpt.partition, ids[i : i + 16], 0, k).float()
                 for i in range(0, n, 16)]  # fmt: skip
    hidden = torch.cat(parts).numpy()
    out.mkdir(parents=True, exist_ok=True)
    write_file(path, lambda f: np.save(f, hidden))
    info = {"model": model, "config": CONFIGS[model], "arch": cfg.model.arch,
            "pretrained": cfg.model.checkpoint is not None, "boundary": k, "num_blocks": m,
            "shape": list(hidden.shape), "dtype": "float32", "docs": docs, "seq_len": seq_len,
            "absmax": float(np.abs(hidden).max()), "std": float(hidden.std()),
            "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip
    write_json(path.with_suffix(".json"), info)
    log(f"{model}: wrote {path} {hidden.shape} ({info['seconds']} s)")
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", choices=sorted(CONFIGS), default=["minilm", "gpt2"])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--boundary", type=int)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--tiny", action="store_true", help="gpt2, 8 states of 20 documents (tests)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.model, a.samples, a.docs, a.seq_len = ["gpt2"], 8, 20, 16
    torch.set_num_threads(min(2, torch.get_num_threads()))
    written = {}
    for m in a.model:
        written[m] = str(generate(m, a.out, samples=a.samples, docs=a.docs, seq_len=a.seq_len,
                                  boundary=a.boundary))  # fmt: skip
        print(written[m])
    return {"hidden_states": written}


if __name__ == "__main__":
    main()
