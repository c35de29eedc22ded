"""Benchmarks: clients of preinfer's public API. Run one as a module from the repo root
(`python -m bench.study --quick`), all of them with `make bench`. Shared pieces (results
files, load average, tables) live in bench/harness.py."""
