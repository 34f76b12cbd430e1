"""``scripts.loop_ceilings`` takes parts out of the "f16" kernel by replacing module attributes
that the kernel reads when it is traced, and times each reduced kernel in a process of its
own. What must never happen: a reduced mode timing the shipped kernel (a renamed attribute,
an AOT or earlier cached kernel) under its name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from scripts import loop_ceilings

# in a child process (the replacements are process-wide): each mode's kernel for a small
# "f16" configuration, compiled for sm_120a in turn, and the SASS opcodes that show the parts
_SASS_COUNTS = """
import json, re
from cute_kernels.sass_check import disassemble
from cute_kernels.sparse_mla_decode.config import PartialConfig
from dispatch.policy.variant_space import KernelVariant
from dispatch.runtime.loader import compile_variant
from scripts.loop_ceilings import MODES, take_out

counts = {}
for mode in MODES:  # each mode's replacements on top of the last's: shipped first
    if mode != "shipped":
        take_out(mode)
    cfg = PartialConfig(kv_format="model1_fp8", precision="f16", head_groups=1)
    sass = disassemble(compile_variant(KernelVariant(cfg, "sm_120a"), keep_cubin=True).artifacts.CUBIN)
    counts[mode] = {op: len(re.findall(op, sass)) for op in ("F2FP.F16.E4M3", "MUFU.EX2", "BAR.SYNC", "BAR.RED")}
print(json.dumps(counts))
"""


def test_each_mode_takes_its_part_out_of_the_compiled_kernel():
    done = subprocess.run([sys.executable, "-c", _SASS_COUNTS], check=True, capture_output=True, text=True)
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    shipped = counts["shipped"]
    assert shipped["F2FP.F16.E4M3"] > 0 and shipped["MUFU.EX2"] > 0 and shipped["BAR.SYNC"] > 0
    # no softmax: no exponential left (this configuration has no sink); conversions and barriers kept
    assert counts["no_softmax"]["MUFU.EX2"] == 0
    assert counts["no_softmax"]["F2FP.F16.E4M3"] == shipped["F2FP.F16.E4M3"]
    assert counts["no_softmax"]["BAR.SYNC"] > 0
    assert counts["no_softmax_no_conversion"]["F2FP.F16.E4M3"] == 0
    assert counts["no_softmax_no_barriers"]["BAR.SYNC"] == counts["no_softmax_no_barriers"]["BAR.RED"] == 0


def test_a_reduced_mode_compiles_into_this_runs_cache_and_never_loads_aot(tmp_path):
    shipped = loop_ceilings.child_env("shipped", str(tmp_path))
    assert shipped.get("DSV4_MLA_CACHE_DIR") == os.environ.get("DSV4_MLA_CACHE_DIR")  # where the loader finds them
    for mode in loop_ceilings.MODES[1:]:
        assert loop_ceilings.child_env(mode, str(tmp_path))["DSV4_MLA_CACHE_DIR"] == str(tmp_path / mode)
    # a child told to use AOT kernels only still compiles, and searches no AOT directory
    code = ("from scripts.loop_ceilings import reduce_kernels; from dispatch.runtime import loader; "
            "assert loader.require_aot(); reduce_kernels('no_softmax'); "
            "assert loader.aot_dirs() == [] and not loader.require_aot()")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env=dict(os.environ, DSV4_MLA_REQUIRE_AOT="1", DSV4_MLA_AOT_DIR=str(tmp_path)))
