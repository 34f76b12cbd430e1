#!/usr/bin/env bash
# The GPU suite, as run on the lent H200 (see README "Running on the GPU host"):
#   source .devwheels/setup_cutedsl.sh .devwheels && export PYTHONPATH=$PWD:$PYTHONPATH && bash scripts/gpu_suite.sh
# Writes the pytest log under $OUT (when set) and ends with the pytest summary line.
set -o pipefail
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
python3 -m pytest tests -m gpu -q -rf -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_pytest.log"
