"""Benchmarks: clients of preinfer's public API. Run one as a module from the repo root
(`python -m bench.study --quick`), all of them with `make bench`. Shared pieces: results files,
load, tables and the arithmetic on curves in bench/harness.py; the arm runner, the peak-memory
child and one block's training step in bench/arms.py."""
