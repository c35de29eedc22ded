"""Tools above the benchmarks: `make real-model` (tools/real_model.py). May import any layer."""
