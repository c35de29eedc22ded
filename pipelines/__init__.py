"""The stages, one module each, and the `preinfer` command line (pipelines/cli.py). init, eval,
export and report are thin over preinfer/ (config in, the library's work, records out); the
others hold logic of their own: tokenize (scan the corpus, reuse or refuse the store, train
the tokenizer, pack and write it: one long `run_tokenize`), cache build and refresh (plan the
shards, drive the workers), train (Ray Train workers) and bcd (the rotation and its resume).
Builds run in this process or on a pool of Ray actors, visits in this process or under Ray
Train; the same commands work locally and as Ray cluster jobs.

Public surface: the stage functions, as the CLI and the benchmarks call them.
"""

from pipelines.bcd import run_bcd
from pipelines.cache_build import build_cache, refresh_cache
from pipelines.eval import run_eval
from pipelines.export import run_export
from pipelines.init import run_init
from pipelines.report import run_report
from pipelines.tokenize import run_tokenize
from pipelines.train import run_train

__all__ = [
    "build_cache", "refresh_cache", "run_bcd", "run_eval", "run_export", "run_init", "run_report",
    "run_tokenize", "run_train",
]  # fmt: skip
