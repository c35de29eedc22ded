#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): runs from the source tree on the machine's own Python and
# CUDA torch, installs nothing, names any missing import, writes OUT_DIR/gpu_check.json.
#   bash bench/gpu_check.sh [OUT_DIR [STEP ...]]   (default runs/gpu_check, every step; <= 8 min
#   on one GPU). The pre-inference checks alone (build / bare forward, the writer), ~6 min:
#   bash bench/gpu_check.sh "$OUT" throughput writer
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 480 "$PY" -m bench.gpu_check "${1:-runs/gpu_check}" "${@:2}"
