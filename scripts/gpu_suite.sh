#!/usr/bin/env bash
# The GPU test suite (the tests marked gpu) on a machine with a CUDA GPU, from the checkout's
# root with the package importable (installed, or PYTHONPATH=$PWD; docs/contributing.md):
#   bash scripts/gpu_suite.sh [pytest arguments ...]
# Writes the pytest log to $OUT/gpu_pytest.log ($OUT defaults to /tmp) and ends with pytest's
# summary line.
set -o pipefail
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
python3 -m pytest tests -m gpu -q -rf -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_pytest.log"
