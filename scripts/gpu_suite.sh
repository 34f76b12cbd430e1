#!/usr/bin/env bash
# The GPU test suite (the tests marked gpu) on a machine with a CUDA GPU, from the checkout's
# root with the package importable (installed, or PYTHONPATH=$PWD; docs/contributing.md):
#   bash scripts/gpu_suite.sh [pytest arguments ...]
#   DSV4_MLA_ARCH_PROFILE=sm_80 bash scripts/gpu_suite.sh    # sm_80's code on this GPU (or sm_86, sm_89)
# Writes the pytest log to $OUT/gpu_pytest.log ($OUT defaults to /tmp) and ends with pytest's
# summary line. Under an arch profile (cute_kernels/arch.py) it first builds the profile's
# registry in $JOBS processes (default: every CPU) into $OUT/aot_<profile>, unless that is
# up to date, and serves it from there (DSV4_MLA_AOT_DIR); what only the tests' forced
# choices use is compiled on first use.
set -o pipefail
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
if [ -n "${DSV4_MLA_ARCH_PROFILE:-}" ]; then
  target="$(python3 -c 'import torch; from cute_kernels.arch import arch_for_capability as a; print(a(torch.cuda.get_device_capability()))')" || exit 1
  echo "arch profile $target: the ${DSV4_MLA_ARCH_PROFILE} build's code, compiled for this GPU"
  python3 -m dispatch.tools.aot_build --arch "$target" --out "$out/aot_$target" --jobs "${JOBS:-$(nproc)}" \
    > "$out/aot_$target.log" 2>&1 || { tail -20 "$out/aot_$target.log"; exit 1; }
  grep -E "^(built in|$target: )" "$out/aot_$target.log"
  export DSV4_MLA_AOT_DIR="$out/aot_$target"
fi
python3 -m pytest tests -m gpu -q -rf -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_pytest.log"
