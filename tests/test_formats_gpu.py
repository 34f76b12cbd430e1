"""The decode kernels on the inline-scale cache formats (and MODEL1 through the same code)
against the float64 reference, on a CUDA GPU (the GPU tests are skipped without one;
``test_case_inputs_*`` run anywhere). DeepSeek-V4's caches, FP8 and NVFP4, have their cases
in ``tests/test_decode_gpu.py``.

Conventions of ``tests/test_decode_gpu.py``: each case draws its inputs from its own fixed seed
(printed on failure), poisons the outputs (NaN) before the launch, runs the call twice and
requires bit-identical results (a moving result is a race); bounds: ``tests/tolerances.py``
(out within 2x the rounding floor, the reference rounded to bf16 or, for "fp8", the FP8 path's
own rounding model; lse within 1e-5).

NaN (0xFF) fills every byte no valid entry may read: blocks 0 and 3 (block 0 holds slot 0, the
slot a masked entry would read if it were gathered and multiplied by 0), the padding bytes of
padded rows and page gaps, and the 128 unused bytes of GLM-5.3 rows in 656-byte pool rows. The
reference and the FP8 model are evaluated on a clean twin of the cache (the same bytes without
the poisoned blocks): their answer does not depend on bytes the semantics never read.

Coverage, not the cartesian product (each distinct kernel variant compiles once per process):
every format x precision ("f16", "bf16", "fp8"), and across the cases every value of heads
{1, 8, 16, 64, 128}, topk {1, 100, 2048, 2176}, T {1, 7, 64, 300}, page {1, 37, 64, 256}, the
layouts (NHD, HND, flat, float8 views), padded rows and page gaps, lengths, -1 and out-of-range
slots, empty rows, sinks (finite, +inf, -inf), power-of-two and arbitrary FP32 scales over many
binades, and the bottom of the scales ("tiny"). On an H200 (132 SMs) the cases select, per
cache format: "f16" 4 partial variants (one head group final / split with lengths; two groups
split / final with lengths and sink), "bf16" and "fp8" 2 each (one group split with lengths, two
groups final with sink); MODEL1 3 more; the merge kernels are the format-free ones.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_readers import gather_slot_parts, gather_slots
from cute_kernels.sparse_mla_decode.cache_view import default_block_stride, read_cache_view
from cute_kernels.sparse_mla_decode.kv_format import get_format
from cute_kernels.sparse_mla_decode.reference import reference_decode
from dispatch import InvalidDecodeInput, sparse_mla_decode
from dispatch.tools.sample_inputs import make_cache, make_indices, view_width
from tests.inputs import lengths_of, sink_of
from tests.tolerances import ACCURACY, check_against_reference, rounding_floor, seed_for

POISON_BLOCKS = (0, 3)  # NaN-filled blocks that no valid index selects


@dataclasses.dataclass(frozen=True)
class Case:
    kv_format: str
    precision: str
    T: int
    H: int
    topk: int
    page: int = 64
    num_blocks: int = 48
    writer: str | None = None  # cache_writers.WRITERS: None is the format's default
    row_stride: int | None = None  # inline formats: bytes between rows (None: the format's first pitch)
    block_pad: int = 0  # page gap: bytes between blocks past the default block stride
    layout: str = "nhd"
    lengths: str | None = None  # None | "random" | "edge"
    sink: str | None = None  # None | "finite" | "+inf" | "-inf" | "mixed"
    invalid: float = 0.0  # fraction of -1 / out-of-range entries
    empty_tokens: bool = False  # every third token selects nothing
    spread: int = 0  # tokens' magnitudes: powers of two over 2 * spread binades
    scale_spread: float = 0.0  # each scale group times 2**u, |u| <= scale_spread (make_cache)
    tiny: bool = False  # the bottom of the format's scales, rope 0 (make_cache); q times 2**118
    sm_scale: float | None = None

    def __str__(self):
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default or f.name in ("T", "H", "topk")]
        return ",".join(fields)


def _format_cases(fmt: str, strides: tuple[int, int], writers: tuple[str, str], topk_big: int) -> list[Case]:
    """The covering set of one inline format: two padded row strides (the first wider than any
    view of the format, the second GLM-5.3's pool pitch where the format has one), the default
    pitch elsewhere; two writers (the first V3.2's power-of-two FlashMLA one where the format
    has it, the second arbitrary FP32 scales)."""
    w_a, w_b = writers
    wide, pool = strides
    return [
        # "f16" (the default path): 1 group final; 1 group split with lengths (and tiny); 2 groups split
        # (H 64, topk 2176: GLM-5.3's calibrated shape) with the merge's sink; 2 groups final, lengths + sink
        Case(fmt, "f16", T=1, H=1, topk=1, page=1, num_blocks=8, row_stride=wide, block_pad=32),
        Case(fmt, "f16", T=7, H=8, topk=100, page=37, num_blocks=60, row_stride=pool, block_pad=160,
             layout="hnd", invalid=0.2, lengths="edge", writer=w_a),
        Case(fmt, "f16", T=4, H=16, topk=192, tiny=True, lengths="random", writer=w_b),
        Case(fmt, "f16", T=16, H=64, topk=2176, writer=w_b, scale_spread=6, spread=2, sink="mixed",
             empty_tokens=True, layout="flat"),
        Case(fmt, "f16", T=300, H=128, topk=100, num_blocks=64, writer=w_a, lengths="random", sink="mixed",
             invalid=0.1, empty_tokens=True, row_stride=wide, layout="fp8", sm_scale=0.05),
        # "bf16": 1 group split with lengths (page 256, scales over many binades); 2 groups final with sink
        Case(fmt, "bf16", T=64, H=16, topk=topk_big, page=256, num_blocks=12, writer=w_b, scale_spread=6, spread=2,
             sink="mixed", empty_tokens=True, lengths="random", row_stride=pool, block_pad=16),
        Case(fmt, "bf16", T=300, H=128, topk=100, num_blocks=64, writer=w_a, sink="-inf", layout="hnd",
             block_pad=64),
        # "fp8" (bounds against the FP8 rounding model): the same two modes
        Case(fmt, "fp8", T=7, H=8, topk=2176, writer=w_b, scale_spread=6, lengths="edge", invalid=0.2,
             row_stride=wide, block_pad=32),
        Case(fmt, "fp8", T=64, H=64, topk=100, writer=w_b, sink="mixed", empty_tokens=True, layout="hnd",
             row_stride=pool),
    ]


CASES = [
    *_format_cases("v32_fp8", (672, 704), ("flashmla", "vllm"), 2048),
    *_format_cases("glm_nope_fp8", (672, 656), ("vllm", "b12x"), 2176),
    # MODEL1 through the same code (its own tests: tests/test_decode_gpu.py)
    Case("model1_fp8", "f16", T=7, H=8, topk=100, page=37, num_blocks=60, invalid=0.2, lengths="edge", layout="hnd",
         block_pad=1024),
    Case("model1_fp8", "bf16", T=300, H=128, topk=100, num_blocks=64, sink="mixed", writer="flashmla",
         scale_spread=4),
    Case("model1_fp8", "fp8", T=7, H=8, topk=2176, lengths="edge", invalid=0.2, spread=4, scale_spread=4,
         sink="mixed"),
]
# the block-scaled form reads UE8M0 scales only (MODEL1), on sm_120a / sm_121a
MXF8_CASES = [Case("model1_fp8", "mxf8", T=7, H=8, topk=2176, lengths="edge", invalid=0.2, scale_spread=4,
                   sink="mixed")]


def block_stride_of(case: Case) -> int:
    fmt = get_format(case.kv_format)
    return default_block_stride(fmt, case.page, case.row_stride if fmt.inline else None) + case.block_pad


def build_inputs(case: Case, device, seed: int):
    """(q, the cache with its poisoned blocks, its clean twin, indices, call keywords)."""
    fmt = get_format(case.kv_format)
    gen = torch.Generator().manual_seed(seed)
    cache_seed = int(torch.randint(0, 2**62, (1,), generator=gen))

    def cache(poison):
        return make_cache(case.num_blocks, case.page, device=device, kv_format=case.kv_format, writer=case.writer,
                          row_stride=case.row_stride, block_stride=block_stride_of(case), poison_blocks=poison,
                          layout=case.layout, gen=torch.Generator().manual_seed(cache_seed), spread=case.spread,
                          scale_spread=case.scale_spread, tiny=case.tiny)

    poisoned, clean = cache(POISON_BLOCKS), cache(())
    usable = [b for b in range(case.num_blocks) if b not in POISON_BLOCKS]
    idx = make_indices(case.T, case.topk, case.num_blocks * case.page, device=device, usable_blocks=usable,
                       page=case.page, invalid_frac=case.invalid, gen=gen)
    if case.empty_tokens:
        idx[::3] = -1
    lengths, sink = lengths_of(case.lengths, case.T, case.topk, gen), sink_of(case.sink, case.H, gen)
    kw = dict(topk_length=None if lengths is None else lengths.to(device),
              attn_sink=None if sink is None else sink.to(device), sm_scale=case.sm_scale, kv_format=case.kv_format)
    q = torch.randn(case.T, case.H, fmt.d_qk, generator=gen)
    if case.tiny:
        q = q * 2.0**118  # keys below 2**-115: scores O(1)
    return q.to(torch.bfloat16).to(device), poisoned, clean, idx, kw


def run_twice(case: Case, call, device, seed: int) -> list:
    """``call(out, lse)`` twice into NaN-poisoned outputs; the two results, checked equal."""
    outs = []
    for _ in range(2):
        out = torch.full((case.T, case.H, 512), math.nan, dtype=torch.bfloat16, device=device)
        lse = torch.full((case.T, case.H), math.nan, dtype=torch.float32, device=device)
        call(out, lse)
        outs.append((out.clone(), lse.clone()))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), \
        f"[seed {seed}] {case}: two runs on the same inputs differ: a race"
    return outs


def check_case(case: Case, seed: int, out, lse, q, clean, idx, kw):
    """``out`` / ``lse`` against the reference on the clean twin. For "fp8" the floor is the FP8
    path's rounding model, ``fp8_model.fp8_path_decode`` called (through
    ``tolerances.rounding_floor``) with ``kv_format`` among its keywords."""
    ref_out, ref_lse = reference_decode(q, clean, idx, **kw)
    floor = rounding_floor(case.precision, q, cache=clean, idx=idx, kw=kw, ref_out=ref_out)
    rel, lse_err, ratio = check_against_reference(out, lse, ref_out, ref_lse, floor=floor, seed=seed,
                                                  what=f"{case.precision} {case}")
    ACCURACY.append((f"formats {case}", rel, lse_err, ratio))


def _run_case(case: Case):
    device = torch.device("cuda")
    seed = seed_for(f"formats {case}")
    q, cache, clean, idx, kw = build_inputs(case, device, seed)

    def call(out, lse):
        got_out, got_lse = sparse_mla_decode(q, cache, idx, out=out, lse=lse, precision=case.precision, **kw)
        assert got_out is out and got_lse is lse, "out/lse given must be written in place and returned"

    outs = run_twice(case, call, device, seed)
    check_case(case, seed, outs[0][0], outs[0][1], q, clean, idx, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [pytest.param(c, id=str(c), marks=[pytest.mark.e4m3_mma] if c.precision == "fp8" else [])
                                  for c in CASES])
def test_format_matches_reference(case: Case):
    _run_case(case)


@pytest.mark.gpu
@pytest.mark.block_scaled
@pytest.mark.parametrize("case", MXF8_CASES, ids=str)
def test_block_scaled_model1_matches_reference(case: Case):
    _run_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["v32_fp8", "glm_nope_fp8"])
def test_block_scaled_form_is_refused_for_fp32_scales(kv_format):
    """precision="mxf8" feeds UE8M0 scale bytes to the MMA: a format of FP32 scales is refused
    (on every GPU), before any launch, and the outputs are untouched."""
    device = torch.device("cuda")
    case = Case(kv_format, "mxf8", T=2, H=16, topk=64)
    q, cache, _, idx, kw = build_inputs(case, device, seed_for(f"mxf8 refused {kv_format}"))
    out = torch.full((2, 16, 512), math.nan, dtype=torch.bfloat16, device=device)
    with pytest.raises(InvalidDecodeInput, match="mxf8"):
        sparse_mla_decode(q, cache, idx, out=out, precision="mxf8", **kw)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


# ---------------------------------------------------------------------- the cases' inputs (any machine)
def test_the_cases_cover_every_axis():
    """The covering set holds every value the file promises, for every format and precision."""
    inline = [c for c in CASES if c.kv_format != "model1_fp8"]
    for fmt in ("v32_fp8", "glm_nope_fp8", "model1_fp8"):
        assert {c.precision for c in CASES if c.kv_format == fmt} == {"f16", "bf16", "fp8"}
    for fmt in ("v32_fp8", "glm_nope_fp8"):
        mine = [c for c in inline if c.kv_format == fmt]
        assert {c.H for c in mine} >= {1, 8, 16, 64, 128}
        assert {c.topk for c in mine} >= {1, 100, 2176} and {c.T for c in mine} >= {1, 7, 64, 300}
        assert {c.page for c in mine} >= {1, 37, 64, 256} and {c.layout for c in mine} == {"nhd", "hnd", "flat", "fp8"}
        assert any(c.block_pad for c in mine) and any(c.row_stride not in (None, 528, 656) for c in mine)
        assert {c.lengths for c in mine} >= {"edge", "random"} and any(c.invalid for c in mine)
        assert any(c.empty_tokens for c in mine) and any(c.tiny for c in mine) and any(c.scale_spread for c in mine)
        assert {c.sink for c in mine} >= {"mixed", "-inf"}
        for precision in ("f16", "bf16", "fp8"):  # arbitrary FP32 scales over many binades on every path
            assert any(c.precision == precision and c.writer in ("vllm", "sglang", "b12x") and c.scale_spread
                       for c in mine)
    assert any(c.topk == 2048 for c in inline)
    assert any(c.kv_format == "glm_nope_fp8" and c.row_stride == 656 for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_case_inputs_are_what_the_case_says(case: Case):
    """On the CPU: the views (width, strides) of the case, NaN exactly in the poisoned blocks and
    in no byte of the clean twin a valid entry reads, the two caches equal elsewhere, no valid
    index into a poisoned block, -1 / out-of-range entries where asked."""
    fmt = get_format(case.kv_format)
    q, cache, clean, idx, kw = build_inputs(case, torch.device("cpu"), seed_for(f"formats {case}"))
    assert q.shape == (case.T, case.H, fmt.d_qk) and q.dtype == torch.bfloat16 and idx.shape == (case.T, case.topk)
    view, clean_view = read_cache_view(cache, case.kv_format), read_cache_view(clean, case.kv_format)
    pitch = (case.row_stride or fmt.row_pitches[0]) if fmt.inline else fmt.bytes_per_token
    assert view.block_stride == block_stride_of(case) and view.page_block_size == case.page
    if case.page > 1:
        assert view.row_stride == pitch
    if case.layout != "flat":
        assert cache.shape[-1] == view_width(case.kv_format, pitch)
    assert (cache.dtype == torch.float8_e4m3fn) == (case.layout == "fp8")
    poisoned = torch.isin(torch.arange(case.num_blocks), torch.tensor(POISON_BLOCKS))
    assert (view.blocks[poisoned] == 0xFF).all()
    assert torch.equal(view.blocks[~poisoned], clean_view.blocks[~poisoned])
    valid = (idx >= 0) & (idx < case.num_blocks * case.page)
    assert not torch.isin(idx[valid].long() // case.page, torch.tensor(POISON_BLOCKS)).any()
    if case.invalid:
        assert (~valid).any()
    if case.empty_tokens:
        assert (idx[::3] == -1).all()
    slots = idx[valid].long().unique()
    assert torch.isfinite(gather_slots(clean_view, slots)).all()
    if case.writer in ("vllm", "sglang", "b12x") and fmt.fp32_scales and not case.tiny:
        scales = gather_slot_parts(clean_view, slots)[1]
        assert (torch.frexp(scales).mantissa != 0.5).float().mean() > 0.9  # not powers of two
    if case.T * case.H * case.topk <= 20000:  # the small cases: the reference on the clean twin is finite
        ref_out, ref_lse = reference_decode(q, clean, idx, **kw)
        assert torch.isfinite(ref_out).all() and not torch.isnan(ref_lse).any()
