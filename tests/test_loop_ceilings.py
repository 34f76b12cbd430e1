"""``scripts.loop_ceilings`` takes parts out of the "f16" kernel by replacing module attributes
that the kernel reads when it is traced. A rename or a new signature there must fail here, not
leave the script timing the shipped kernel under a reduced one's name."""

import inspect
import subprocess
import sys

from cute_kernels.sparse_mla_decode import partial_f16, softmax


def test_the_replaced_attributes_are_what_the_kernel_calls():
    assert list(inspect.signature(softmax.SpreadSoftmax.step).parameters) == [
        "self", "sm", "bases", "valid_rows", "tidx", "step", "stage_base"]
    assert list(inspect.signature(softmax.SpreadSoftmax.step_barriers).parameters) == ["self", "step"]
    assert list(inspect.signature(partial_f16.e4m3x4_to_f16x2).parameters) == ["x", "selector"]
    source = inspect.getsource(partial_f16)
    assert "self.softmax.step(" in source and "e4m3x4_to_f16x2(" in source
    assert "cute.arch.sync_threads()" in source  # read through the module attribute, not a copy


def test_take_out_replaces_them():
    # in a child process: the replacements are process-wide
    code = ("from scripts.loop_ceilings import take_out; "
            "from cute_kernels.sparse_mla_decode import partial_f16, softmax; "
            "before = (softmax.SpreadSoftmax.step, partial_f16.e4m3x4_to_f16x2); "
            "take_out('no_softmax_no_conversion'); "
            "assert softmax.SpreadSoftmax.step is not before[0]; "
            "assert partial_f16.e4m3x4_to_f16x2 is not before[1]; "
            "assert partial_f16.e4m3x4_to_f16x2(7) == [7, 7]")
    subprocess.run([sys.executable, "-c", code], check=True)
    code = ("from scripts.loop_ceilings import take_out; import cutlass.cute as cute; "
            "from cute_kernels.sparse_mla_decode import softmax; "
            "before = (softmax.SpreadSoftmax.step, cute.arch.sync_threads); "
            "take_out('no_softmax_no_barriers'); "
            "assert softmax.SpreadSoftmax.step is not before[0] and cute.arch.sync_threads is not before[1]; "
            "assert cute.arch.sync_threads() is None")
    subprocess.run([sys.executable, "-c", code], check=True)
