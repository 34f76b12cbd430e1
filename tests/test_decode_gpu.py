"""The decode kernels on DeepSeek-V4's caches (MODEL1 FP8, and NVFP4: ``NVFP4_CASES``), on
DeepSeek-V4.1's own records (``V41_CASES``) and on both models' pairings of two formats
(``MIXED_CASES``) against the float64 reference, on a CUDA GPU (skipped without one).

Every case draws its random inputs from its own fixed seed (printed on failure), poisons the
outputs (NaN) before the launch, leaves NaN bytes in cache blocks nobody selected and in the
padding between blocks, runs the call twice and requires bit-identical results (a moving
result is a race). Bounds: ``tests/tolerances.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_view import read_cache_view
from cute_kernels.sparse_mla_decode.kv_format import get_format
from cute_kernels.sparse_mla_decode.reference import reference_decode
from dispatch import PlanOverrides, plan_sparse_mla_decode, sparse_mla_decode, validate_call
from dispatch.policy.selection import select_for_call
from dispatch.policy.occupancy import bounded_f16_head_groups, two_bounded_f16_ctas_fit
from tests.conftest import gpu_target
from dispatch.tools.sample_inputs import make_cache, make_indices
from tests.inputs import lengths_of, sink_of
from tests.tolerances import ACCURACY, check_against_reference, rounding_floor, seed_for

pytestmark = pytest.mark.gpu

POISON_BLOCKS = (1, 4)  # NaN-filled blocks that no index selects


@dataclasses.dataclass(frozen=True)
class Case:
    T: int
    H: int
    topk: int
    page: int = 64
    num_blocks: int = 48
    extra_topk: int | None = None  # None: no extra cache
    extra_page: int = 64
    extra_blocks: int = 40
    lengths: str | None = None  # None | "random" | "short" | "edge" (``tests.inputs.lengths_of``)
    extra_lengths: str | None = None
    sink: str | None = None  # None | "finite" | "+inf" | "-inf" | "mixed"
    invalid: float = 0.0  # fraction of out-of-range / -1 entries
    empty_tokens: bool = False  # some tokens select nothing
    duplicates: bool = False  # every entry of a token is the same slot
    layout: str = "nhd"
    extra_layout: str = "nhd"
    block_stride: int | None = None
    q4d: bool = False  # q [B, S, H, 512], indices [B, S, topk]
    q_head_pad: int = 0  # extra elements between heads of q (a strided view)
    sm_scale: float | None = None
    spread: int = 0  # tokens' magnitudes differ by up to 2**(2 * spread) (their scale bytes by 2 * spread)
    tiny: bool = False  # the bottom scales and rope 0 in every cache (``make_cache``), q scaled up to match
    invalid_prefix: int = 0  # the first this many entries of every token are -1
    kv_format: str = "model1_fp8"  # the main cache's format
    extra_kv_format: str | None = None  # the extra cache's (None: the main's)

    def __str__(self):
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default or f.name in ("T", "H", "topk")]
        return ",".join(fields)


CASES = [
    Case(T=1, H=16, topk=128),
    Case(T=1, H=1, topk=1),
    Case(T=5, H=4, topk=64, invalid=0.3),
    Case(T=7, H=8, topk=100, page=37, num_blocks=60, invalid=0.2),
    Case(T=16, H=24, topk=192, page=256, num_blocks=12),
    Case(T=64, H=32, topk=256, lengths="edge"),
    Case(T=65, H=64, topk=512, sink="finite", lengths="random"),
    Case(T=300, H=128, topk=128, num_blocks=64),
    Case(T=8, H=128, topk=1024, sink="mixed", invalid=0.1),
    Case(T=2, H=64, topk=1152, sink="+inf"),
    Case(T=3, H=16, topk=2048, empty_tokens=True, sink="-inf"),
    Case(T=1, H=8, topk=4096, invalid=0.05, lengths="random"),  # 128 splits: the most one merge combines
    Case(T=4, H=16, topk=128, extra_topk=512),
    Case(T=2, H=64, topk=128, extra_topk=1024, extra_page=2, extra_blocks=700, extra_lengths="edge"),
    Case(T=5, H=16, topk=128, extra_topk=512, extra_page=32, extra_blocks=80, lengths="random",
         extra_lengths="random", sink="finite"),
    Case(T=2, H=8, topk=128, extra_topk=8192, extra_page=64, extra_blocks=160, invalid=0.05),
    # vLLM's ratio-128 rows: 8192 wide, a few hundred valid; the live chunks dealt out across
    # the splits planned for the width, most splits empty
    Case(T=3, H=16, topk=128, extra_topk=8192, extra_page=2, extra_blocks=300, lengths="random",
         extra_lengths="short", sink="finite"),
    Case(T=7, H=16, topk=100, extra_topk=300, extra_page=2, extra_blocks=300, lengths="edge", extra_lengths="edge"),
    Case(T=7, H=32, topk=64, extra_topk=0),
    Case(T=16, H=128, topk=256, extra_topk=512, extra_page=256, extra_blocks=8, empty_tokens=True, sink="finite"),
    Case(T=5, H=16, topk=192, layout="hnd", extra_topk=64, extra_layout="flat"),
    Case(T=5, H=16, topk=256, layout="fp8", block_stride=37376 + 1024),
    Case(T=7, H=4, topk=100, layout="flat", q4d=True, q_head_pad=8, sm_scale=0.1),
    Case(T=3, H=16, topk=512, duplicates=True),
    Case(T=65, H=1, topk=1, empty_tokens=True),
    # large T x H: one split per token on any GPU of up to 1200 SMs, so the partial kernel
    # writes out/lse itself (final mode), with and without a sink
    Case(T=300, H=128, topk=128, sink="mixed", lengths="edge", extra_topk=64, extra_page=2, extra_blocks=300,
         extra_lengths="random", invalid=0.1, empty_tokens=True),
    Case(T=700, H=64, topk=192, sink="finite", q_head_pad=16),
    # per-token magnitudes over 16 binades: the scales folded into P ("f16", "fp8") stay
    # relative to the split's largest
    Case(T=6, H=32, topk=512, spread=8),
    Case(T=3, H=16, topk=128, extra_topk=256, spread=8, sink="finite", lengths="random"),
    # scale byte 0 is 2**-127, not 0: keys and values in the bottom binades of UE8M0, q near
    # the top of bf16's range so that the scores are O(1) and every byte counts in them
    Case(T=4, H=16, topk=192, extra_topk=64, tiny=True),
    # a CTA's first chunk selects nothing (the softmax's reference max is still -inf in the
    # second, whose valid entries must take the exact step) and the spread moves the max in
    # later chunks: two splits of 8 chunks per token
    Case(T=64, H=32, topk=512, invalid_prefix=40, spread=8),
]


def _nvfp4(case: Case) -> Case:
    """``case`` on NVFP4 caches (a MODEL1 block stride given becomes the same padding past an
    NVFP4 block)."""
    pad = None if case.block_stride is None else case.block_stride - case.page * 584
    return dataclasses.replace(case, kv_format="model1_nvfp4",
                               block_stride=None if pad is None else case.page * 384 + pad)


# every MODEL1 case again on NVFP4 caches (e2m1 values with E4M3 scales per 16 dims, "f16"
# only), and the shapes the NVFP4 format adds: 1152 entries (V4.1's width) with the extra list
NVFP4_CASES = [_nvfp4(c) for c in CASES] + [
    Case(T=3, H=64, topk=1152, extra_topk=512, extra_page=32, extra_blocks=80, sink="mixed", invalid=0.1,
         lengths="random", extra_lengths="edge", kv_format="model1_nvfp4"),
]


# DeepSeek-V4.1's records: the 528-byte FP8 rows (UE8M0 per 32 dims, footer or inline scales,
# the inline ones addressed as flat rows) alone and with the 288-byte NVFP4 extra rows; heads
# {1, 8, 16, 64, 128}, topk {1, 100, 512, 1152}, extra topk up to 8192, pages {2, 32, 37, 64, 256},
# padded blocks (flat rows R = block stride / pitch > P)
V41_CASES = [
    Case(T=1, H=16, topk=128, kv_format="v41_fp8"),
    Case(T=5, H=8, topk=100, page=37, num_blocks=60, invalid=0.2, kv_format="v41_fp8"),
    Case(T=7, H=4, topk=100, page=37, num_blocks=60, invalid=0.2, lengths="edge", kv_format="v41_fp8_inline",
         block_stride=(37 + 3) * 528),
    Case(T=65, H=1, topk=1, empty_tokens=True, kv_format="v41_fp8_inline"),
    Case(T=6, H=32, topk=512, spread=8, sink="finite", kv_format="v41_fp8"),
    Case(T=4, H=16, topk=192, extra_topk=64, tiny=True, kv_format="v41_fp8"),
    Case(T=64, H=32, topk=512, invalid_prefix=40, spread=8, kv_format="v41_fp8_inline"),
    Case(T=8, H=128, topk=1024, sink="mixed", invalid=0.1, kv_format="v41_fp8"),
    Case(T=3, H=64, topk=1152, extra_topk=512, extra_page=32, extra_blocks=80, sink="mixed", invalid=0.1,
         lengths="random", extra_lengths="edge", kv_format="v41_fp8"),
    Case(T=3, H=64, topk=1152, extra_topk=512, extra_page=32, extra_blocks=80, sink="mixed", invalid=0.1,
         lengths="random", extra_lengths="edge", kv_format="v41_fp8", extra_kv_format="v41_nvfp4"),
    Case(T=2, H=128, topk=512, extra_topk=8192, extra_page=256, extra_blocks=40, invalid=0.05, sink="-inf",
         kv_format="v41_fp8_inline", extra_kv_format="v41_nvfp4_inline", block_stride=(64 + 16) * 528),
    Case(T=7, H=16, topk=100, extra_topk=300, extra_page=2, extra_blocks=300, lengths="edge", extra_lengths="edge",
         empty_tokens=True, kv_format="v41_fp8_inline"),
    Case(T=300, H=64, topk=128, extra_topk=64, extra_page=2, extra_blocks=300, sink="mixed", lengths="edge",
         extra_lengths="random", invalid=0.1, kv_format="v41_fp8_inline", extra_kv_format="v41_nvfp4_inline"),
]
# DeepSeek-V4's FP8 and NVFP4 records, one for each cache (a partial kernel per list, then the merge)
MIXED_CASES = [
    Case(T=4, H=16, topk=128, extra_topk=512, extra_kv_format="model1_nvfp4"),
    Case(T=4, H=16, topk=128, extra_topk=512, kv_format="model1_nvfp4", extra_kv_format="model1_fp8"),
    Case(T=2, H=8, topk=128, extra_topk=8192, extra_page=64, extra_blocks=160, invalid=0.05,
         kv_format="model1_nvfp4", extra_kv_format="model1_fp8"),
    Case(T=16, H=128, topk=256, extra_topk=512, extra_page=256, extra_blocks=8, empty_tokens=True, sink="finite",
         extra_kv_format="model1_nvfp4"),
    Case(T=5, H=1, topk=1, extra_topk=100, extra_page=2, extra_blocks=300, lengths="edge", extra_lengths="random",
         sink="+inf", extra_kv_format="model1_nvfp4"),
    Case(T=7, H=32, topk=64, extra_topk=0, extra_kv_format="model1_nvfp4"),  # an empty extra list: one kernel
    Case(T=3, H=16, topk=128, extra_topk=256, spread=8, sink="finite", lengths="random", kv_format="model1_nvfp4",
         extra_kv_format="model1_fp8"),
]


def _on(t, device):
    return None if t is None else t.to(device)


def _index_space(cache, fmt_name: str) -> dict:
    """``make_indices``' arguments for a cache's indices: the rows per block an index counts
    (``CacheView.index_page``: P, or R for a flat-row format's padded blocks) and the indices
    inside the cache."""
    view = read_cache_view(cache, fmt_name)
    return dict(index_page=view.index_page, num_slots=view.num_slots)


def build_inputs(case: Case, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    usable = [b for b in range(case.num_blocks) if b not in POISON_BLOCKS]
    cache = make_cache(case.num_blocks, case.page, device=device, poison_blocks=POISON_BLOCKS,
                       layout=case.layout, block_stride=case.block_stride, gen=gen, spread=case.spread,
                       tiny=case.tiny, kv_format=case.kv_format)
    idx = make_indices(case.T, case.topk, device=device, usable_blocks=usable, page=case.page,
                       invalid_frac=case.invalid, gen=gen, **_index_space(cache, case.kv_format))
    if case.duplicates:
        idx = idx[:, :1].expand(-1, case.topk).contiguous()
    if case.empty_tokens:
        idx[::3] = -1
    idx[:, :case.invalid_prefix] = -1
    kw = dict(
        topk_length=_on(lengths_of(case.lengths, case.T, case.topk, gen), device),
        attn_sink=_on(sink_of(case.sink, case.H, gen), device),
        sm_scale=case.sm_scale,
        kv_format=case.kv_format,
    )
    if case.extra_topk is not None:
        extra_format = case.extra_kv_format or case.kv_format
        e_usable = [b for b in range(case.extra_blocks) if b not in POISON_BLOCKS]
        kw["extra_kv_cache"] = make_cache(case.extra_blocks, case.extra_page, device=device,
                                          poison_blocks=POISON_BLOCKS, layout=case.extra_layout, gen=gen,
                                          spread=case.spread, tiny=case.tiny, kv_format=extra_format)
        kw["extra_kv_format"] = case.extra_kv_format
        e_idx = make_indices(case.T, case.extra_topk, device=device, usable_blocks=e_usable, page=case.extra_page,
                             invalid_frac=case.invalid, gen=gen, **_index_space(kw["extra_kv_cache"], extra_format))
        if case.empty_tokens:
            e_idx[::3] = -1
        kw["extra_indices"] = e_idx
        kw["extra_topk_length"] = _on(lengths_of(case.extra_lengths, case.T, case.extra_topk, gen), device)
    q = torch.randn(case.T, case.H, 512 + case.q_head_pad, generator=gen).to(torch.bfloat16).to(device)
    if case.tiny:  # scores O(1) on keys of the bottom scales: UE8M0 ~2**-127, NVFP4 ~2**-8 (``make_cache``)
        q = q * (2.0**118 if get_format(case.kv_format).scale_type == "ue8m0" else 2.0**6)
    q = q[..., :512]
    return q, cache, idx, kw


def check_case(case, precision, seed, outs, q, cache, idx, kw, what: str):
    """The first of ``outs`` against the reference; records the case's accuracy."""
    ref_out, ref_lse = reference_decode(q, cache, idx, **kw)
    floor = rounding_floor(precision, q, cache=cache, idx=idx, kw=kw, ref_out=ref_out)
    rel, lse_err, ratio = check_against_reference(outs[0][0], outs[0][1], ref_out, ref_lse, floor=floor, seed=seed,
                                                  what=f"{what} {case}")
    ACCURACY.append((f"{what} {case}", rel, lse_err, ratio))


def run_twice(case: Case, q, idx, call, seed: int) -> list:
    """``call(q, idx, out, lse)`` twice into NaN-poisoned outputs (q and indices as [B, 1, ..]
    for a ``q4d`` case); the two results as [T, H, 512] / [T, H], checked equal (a race would
    show as a difference)."""
    lead = (case.T,)
    if case.q4d:  # [B, S, H, 512] with B * S = T (T is a multiple of the batch here or S = 1)
        q, idx, lead = q.unsqueeze(1), idx.unsqueeze(1), (case.T, 1)
    outs = []
    for _ in range(2):
        out = torch.full((*lead, case.H, 512), math.nan, dtype=torch.bfloat16, device=q.device)
        lse = torch.full((*lead, case.H), math.nan, dtype=torch.float32, device=q.device)
        call(q, idx, out, lse)
        outs.append((out.reshape(case.T, case.H, 512).clone(), lse.reshape(case.T, case.H).clone()))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), \
        f"[seed {seed}] {case}: two runs on the same inputs differ: a race"
    return outs


PRECISIONS = ["bf16", "f16", "fp8", "mxf8"]
# the paths some archs lack: their cases skip there (``tests/conftest.py``)
PATH_MARKS = {"fp8": [pytest.mark.e4m3_mma], "mxf8": [pytest.mark.block_scaled]}
DECODE_CASES = ([pytest.param(c, p, id=f"{p}-{c}", marks=PATH_MARKS.get(p, [])) for c in CASES for p in PRECISIONS]
                + [pytest.param(c, "f16", id=f"f16-{c}") for c in NVFP4_CASES + V41_CASES + MIXED_CASES]
                # the "bf16" path reads the V4.1 FP8 records too (not the NVFP4 ones)
                + [pytest.param(c, "bf16", id=f"bf16-{c}") for c in V41_CASES
                   if "bf16" in get_format(c.extra_kv_format or c.kv_format).paths])


@pytest.mark.parametrize("case,precision", DECODE_CASES)
def test_decode_matches_reference(case: Case, precision: str):
    device = torch.device("cuda")
    seed = seed_for(f"{precision} {case}")
    q, cache, idx, kw = build_inputs(case, device, seed)

    def call(q, idx, out, lse):
        got_out, got_lse = sparse_mla_decode(q, cache, idx, out=out, lse=lse, precision=precision, **kw)
        assert got_out is out and got_lse is lse, "out/lse given must be written in place and returned"

    outs = run_twice(case, q, idx, call, seed)
    validated = validate_call(q, cache, idx, precision=precision, **kw)  # the dispatch's choice, for the label
    chosen = select_for_call(validated)
    check_case(case, precision, seed, outs, q, cache, idx, kw,
               f"{precision} groups={chosen.head_groups} splits={chosen.num_splits}")


# "f16" with two head groups (32-head CTAs): what the dispatch picks on sm_120 for many heads
# (``head_groups_for``), forced here on whatever GPU runs the suite
TWO_GROUP_CASES = [c for c in CASES + NVFP4_CASES + V41_CASES + MIXED_CASES if c.H > 16] + [
    Case(T=4, H=48, topk=512, extra_topk=128, sink="mixed", invalid=0.1, lengths="edge", extra_lengths="random"),
    Case(T=3, H=20, topk=96, empty_tokens=True, sink="-inf", spread=8),
    Case(T=3, H=20, topk=96, empty_tokens=True, sink="-inf", spread=8, kv_format="model1_nvfp4"),
]


def _forced_f16_plan_matches_reference(case: Case, what: str, overrides: PlanOverrides):
    """Run ``case`` in "f16" through a plan with the dispatch's choices overridden, check it
    against the reference, and return the plan (for the caller's assertions)."""
    device = torch.device("cuda")
    seed = seed_for(f"f16 {what} {case}")
    q, cache, idx, kw = build_inputs(case, device, seed)
    plans = []
    # the plan fixes the tensors' layouts (and the formats) only
    tensors = {k: v for k, v in kw.items() if k not in ("sm_scale", "kv_format", "extra_kv_format")}

    def call(q, idx, out, lse):
        if not plans:
            plans.append(plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, precision="f16", overrides=overrides,
                                                kv_format=kw["kv_format"], extra_kv_format=kw.get("extra_kv_format"),
                                                **tensors))
        plan = plans[0]
        scratch = plan.new_scratch()
        if scratch is not None:  # NaN in every partial first: each one the merge reads is written by this call
            scratch.fill_(0xFF)
        plan.run(q, cache, idx, out=out, lse=lse, scratch=scratch, sm_scale=kw["sm_scale"], **tensors)

    outs = run_twice(case, q, idx, call, seed)
    plan = plans[0]
    check_case(case, "f16", seed, outs, q, cache, idx, kw,
               f"f16 {what} (forced) splits={plan.num_splits} chunks/split={plan.split.chunks_per_split}")
    return plan


@pytest.mark.parametrize("case", TWO_GROUP_CASES, ids=str)
def test_f16_two_head_groups_match_reference(case: Case):
    plan = _forced_f16_plan_matches_reference(case, "groups=2", PlanOverrides(head_groups=2))
    assert plan.variants[0].config.head_groups == 2


# "f16" two head groups held to 128 registers: the H200's kernel for many heads where its grid
# fills the SMs two CTAs each (``head_groups_for``; the default-path cases of 300 x 128 and
# 700 x 64 run it in final mode), forced here with splits too (its rope warp issues the
# indices late, as without the bound: ``tuning.f16_late_indices``)
@pytest.mark.parametrize("case", TWO_GROUP_CASES, ids=str)
def test_f16_two_head_groups_with_register_bound_match_reference(case: Case):
    target = gpu_target()  # an arch profile: its target's shared memory and bounded kernels
    smem = min(torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor, target.smem_per_sm)
    if not two_bounded_f16_ctas_fit(smem, case.kv_format, 2, bounded_f16_head_groups(target.name)):
        pytest.skip(f"{target.label} plans no bounded 32-head kernel (an SM holds one, or it would spill)")
    plan = _forced_f16_plan_matches_reference(case, "groups=2 bounded",
                                              PlanOverrides(head_groups=2, two_ctas_per_sm=True))
    cfg = plan.variants[0].config
    assert cfg.head_groups == 2 and cfg.two_ctas_per_sm and cfg.max_registers == 128


# "f16" one group without the register bound (sm_120's kernel for up to 16 heads per CTA, and
# the H200's where one CTA per SM is planned), forced where the H200 plans two CTAs per SM: its
# rope warp issues the indices one chunk further ahead (``tuning.f16_late_indices``), which
# only splits of more than stages + 1 = 4 chunks reach (7 of these cases have 6-16 per split
# on the H200; T=16 x 128 and the last one cross from the main list into the extra one there)
FREE_KERNEL_CASES = [c for c in CASES + NVFP4_CASES + V41_CASES + MIXED_CASES if c.T >= 8 and c.H >= 32] + [
    Case(T=100, H=16, topk=100, extra_topk=300, extra_page=32, extra_blocks=80, lengths="random", spread=8),
    Case(T=100, H=16, topk=100, extra_topk=300, extra_page=32, extra_blocks=80, lengths="random", spread=8,
         kv_format="model1_nvfp4"),
]


@pytest.mark.parametrize("case", FREE_KERNEL_CASES, ids=str)
def test_f16_one_group_without_register_bound_matches_reference(case: Case):
    plan = _forced_f16_plan_matches_reference(case, "unbounded", PlanOverrides(head_groups=1, two_ctas_per_sm=False))
    cfg = plan.variants[0].config
    assert cfg.head_groups == 1 and not cfg.two_ctas_per_sm


# every split count class the merge kernel has (1: none; 2..8: one batch of 8; 9..32: one
# of 32; 33..128: several) and both row-stage counts, forced on one "f16" case with lengths,
# a sink, invalid entries and the extra list (128 chunks: equal ranges give these counts)
SPLIT_CASE = Case(T=3, H=24, topk=2048, extra_topk=2048, extra_page=32, extra_blocks=200, lengths="random",
                  extra_lengths="random", sink="mixed", invalid=0.1)


@pytest.mark.parametrize("kv_format", ["model1_fp8", "model1_nvfp4"])
@pytest.mark.parametrize("num_splits,stages", [(1, None), (2, None), (8, 2), (9, None), (32, 3), (43, None),
                                               (128, None)])
def test_forced_splits_and_stages_match_reference(num_splits, stages, kv_format):
    plan = _forced_f16_plan_matches_reference(dataclasses.replace(SPLIT_CASE, kv_format=kv_format),
                                              f"splits={num_splits} stages={stages}",
                                              PlanOverrides(num_splits=num_splits, num_stages=stages))
    assert plan.split.num_splits == num_splits and len(plan.variants) == (1 if num_splits == 1 else 2)
    if stages is not None:
        assert plan.variants[0].config.stages == stages


# A length variant deals a token's live chunks out across the launch's splits (split s of S:
# chunks s, s + S, ...; ``gather.ChunkGather.bound_chunks``): forced split counts that leave most
# splits empty or give a split several chunks, both register bounds, on ratio-128 rows whose
# tokens run from no entry to the full 8192 ("edge") or up to 512 ("short")
LIVE_SPLIT_CASES = [Case(T=6, H=16, topk=128, extra_topk=8192, extra_page=2, extra_blocks=300, lengths="random",
                         extra_lengths=lengths, sink="finite", invalid=0.05) for lengths in ("edge", "short")]


@pytest.mark.parametrize("case", LIVE_SPLIT_CASES, ids=str)
@pytest.mark.parametrize("num_splits,bounded", [(3, False), (20, False), (33, True), (65, True), (87, False)])
def test_dealt_live_chunks_match_reference(case: Case, num_splits: int, bounded: bool):
    if bounded:
        target = gpu_target()
        smem = min(torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor, target.smem_per_sm)
        if not two_bounded_f16_ctas_fit(smem, case.kv_format, 1, bounded_f16_head_groups(target.name)):
            pytest.skip(f"{target.label} plans no bounded 16-head kernel")
    plan = _forced_f16_plan_matches_reference(case, f"dealt splits={num_splits} bounded={bounded}",
                                              PlanOverrides(head_groups=1, num_splits=num_splits,
                                                            two_ctas_per_sm=bounded))
    assert plan.split.num_splits == num_splits and plan.variants[0].config.two_ctas_per_sm == bounded


def test_allocates_outputs_with_leading_shape():
    device = torch.device("cuda")
    case = Case(T=6, H=16, topk=128)
    seed = seed_for("leading shape")
    q, cache, idx, kw = build_inputs(case, device, seed)
    out, lse = sparse_mla_decode(q.view(2, 3, 16, 512), cache, idx.view(2, 3, 128), **kw)
    assert out.shape == (2, 3, 16, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 3, 16) and lse.dtype == torch.float32
    check_case(case, "f16", seed, [(out.view(6, 16, 512), lse.view(6, 16))], q, cache, idx, kw, "leading shape")


@pytest.mark.parametrize("precision,feature", [("mxf8", "block_scaled_mma"), ("fp8", "e4m3_mma")])
def test_a_path_is_refused_where_the_gpu_lacks_its_instruction(precision, feature):
    """precision="mxf8" (SM120's block-scaled MMA) or "fp8" (the e4m3 MMA, sm_89 and later) on
    a GPU (or an arch profile) without it: refused before any launch, naming the arch and the
    instruction it lacks, and the outputs are untouched."""
    import re

    from dispatch import InvalidDecodeInput

    device = torch.device("cuda")
    target = gpu_target()
    if not target.lacks(feature):
        pytest.skip(f"{target.label} has the {precision!r} path's instruction")
    q, cache, idx, kw = build_inputs(Case(T=2, H=16, topk=64), device, seed_for(f"{precision} refused"))
    out = torch.full((2, 16, 512), math.nan, dtype=torch.bfloat16, device=device)
    with pytest.raises(InvalidDecodeInput, match=re.escape(f"'{precision}' is not available on {target.label}: "
                                                           f"{target.lacks(feature)};")):
        sparse_mla_decode(q, cache, idx, out=out, precision=precision, **kw)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


@pytest.mark.parametrize("kv_format", ["model1_fp8", "model1_nvfp4"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_out_rows_only_8_byte_aligned(kv_format, num_splits):
    """``out`` whose rows are 516 elements apart (odd heads start 8 bytes past a 16-byte
    boundary: the alignment the API asks for) in final mode (the partial kernel stores out)
    and split mode (the merge does): right, and the 4 padding elements of each row untouched."""
    device = torch.device("cuda")
    case = Case(T=5, H=24, topk=200, kv_format=kv_format)
    seed = seed_for(f"out rows 8-byte aligned {kv_format} {num_splits}")
    q, cache, idx, kw = build_inputs(case, device, seed)
    tensors = {k: v for k, v in kw.items() if k not in ("sm_scale", "kv_format")}
    wide = torch.full((case.T, case.H, 516), math.nan, dtype=torch.bfloat16, device=device)
    out = wide[..., :512]
    lse = torch.full((case.T, case.H), math.nan, dtype=torch.float32, device=device)
    plan = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, kv_format=kv_format,
                                  overrides=PlanOverrides(num_splits=num_splits), **tensors)
    plan.run(q, cache, idx, out=out, lse=lse, scratch=plan.new_scratch(), sm_scale=kw["sm_scale"], **tensors)
    torch.cuda.synchronize()
    assert plan.split.num_splits == num_splits
    assert torch.isnan(wide[..., 512:]).all(), f"[seed {seed}] a store past a row's 512 elements"
    check_case(case, "f16", seed, [(out.clone(), lse.clone())], q, cache, idx, kw,
               f"f16 out rows 516 apart splits={num_splits}")


def test_a_merged_call_takes_at_most_65535_heads():
    """The merge kernel's grid puts the heads in its y, which CUDA limits to 65,535. A call of
    two cache formats (DeepSeek-V4's FP8 main and NVFP4 extra cache: a partial kernel per list,
    then the merge) with 65,535 heads runs and matches the float64 reference; with 65,536 heads
    it is refused before any launch, naming the limit, and its out is left untouched; so is a
    split forced on a call of one format."""
    from dispatch import InvalidDecodeInput

    device = torch.device("cuda")
    refused = "past CUDA's limit of 65,535 on a grid's y: a call that merges"
    for heads in (65535, 65536):
        case = Case(T=1, H=heads, topk=128, extra_topk=64, sink="finite", lengths="random",
                    extra_kv_format="model1_nvfp4")
        seed = seed_for(f"merge grid {case}")
        q, cache, idx, kw = build_inputs(case, device, seed)
        if heads <= 65535:
            outs = run_twice(case, q, idx, lambda q, idx, out, lse: sparse_mla_decode(q, cache, idx, out=out, lse=lse,
                                                                                       **kw), seed)
            check_case(case, "f16", seed, outs, q, cache, idx, kw, f"f16 {heads} heads, two formats")
            continue
        out = torch.full((1, heads, 512), math.nan, dtype=torch.bfloat16, device=device)
        with pytest.raises(InvalidDecodeInput, match=f"q of shape \\[1, {heads}, 512\\]: .*{refused}"):
            sparse_mla_decode(q, cache, idx, out=out, **kw)
        with pytest.raises(InvalidDecodeInput, match=f"q of shape \\[1, {heads}, 512\\]: .*{refused}"):
            plan_sparse_mla_decode(q, cache, idx, out=out, overrides=PlanOverrides(num_splits=2))
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), f"[seed {seed}] a refused call wrote out"


@pytest.mark.parametrize("kv_format,precision", [
    ("model1_fp8", "f16"), ("model1_fp8", "bf16"), pytest.param("model1_fp8", "fp8", marks=pytest.mark.e4m3_mma),
    ("model1_nvfp4", "f16"),
])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_a_nan_code_in_a_selected_entry_makes_its_tokens_out_nan(kv_format, precision, num_splits):
    """The formats' NaN bytes as the formats define them (e4m3 0x7F / 0xFF; for NVFP4 an E4M3
    scale byte 0x7F, what the V4.1 FP4 writer stores for a group holding a NaN), on every
    path and arch route (the instruction, or sm_80 / sm_86's integer operations with their NaN
    test): one entry of token 1 made NaN makes that token's out and lse NaN in every head, as
    in the float64 reference, and leaves every other token as the reference has it.
    ``num_splits``: the dispatch's plan; one split (the partial kernel writes out and lse);
    three, with token 1's length reaching only its first chunk (the NaN in one split, its
    other splits empty: the merge must not read the token as empty)."""
    device = torch.device("cuda")
    case = Case(T=4, H=16, topk=96, kv_format=kv_format)
    seed = seed_for(f"nan code {precision} splits={num_splits} {case}")
    q, cache, idx, kw = build_inputs(case, device, seed)
    if num_splits == 3:
        kw["topk_length"] = torch.tensor([96, 20, 96, 90], dtype=torch.int32, device=device)
    view = read_cache_view(cache, kv_format)
    slot = int(idx[1, 5])
    others = torch.cat([idx[:1], idx[2:]])
    others[others == slot] = int(idx[1, 6]) if int(idx[1, 6]) != slot else -1
    idx = torch.cat([others[:1], idx[1:2], others[1:]])
    block, row = divmod(slot, view.page_block_size)
    fmt = view.fmt
    if fmt.e2m1:  # the E4M3 scale of the entry's first 16 values, in its footer record
        view.blocks[block, case.page * fmt.row_bytes + row * fmt.footer_bytes] = 0x7F
    else:  # a value in its second nope tile, a negative NaN (a footer format's rows: row_bytes apart)
        view.blocks[block, row * (view.row_stride if fmt.inline else fmt.row_bytes) + 100] = 0xFF
    if num_splits is None:
        out, lse = sparse_mla_decode(q, cache, idx, precision=precision, **kw)
    else:
        tensors = {k: v for k, v in kw.items() if k not in ("sm_scale", "kv_format")}
        out = torch.full((case.T, case.H, 512), -7.0, dtype=torch.bfloat16, device=device)
        lse = torch.full((case.T, case.H), -7.0, dtype=torch.float32, device=device)
        plan = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, precision=precision,
                                      overrides=PlanOverrides(num_splits=num_splits), kv_format=kv_format, **tensors)
        assert plan.num_splits == num_splits
        plan.run(q, cache, idx, out=out, lse=lse, scratch=plan.new_scratch(), sm_scale=kw["sm_scale"], **tensors)
    ref_out, ref_lse = reference_decode(q, cache, idx, **kw)
    torch.cuda.synchronize()
    assert torch.isnan(ref_out[1]).all() and torch.isnan(ref_lse[1]).all()
    assert not torch.isnan(ref_out[[0, 2, 3]]).any()
    what = f"[seed {seed}] a NaN code in token 1's entries ({precision}, num_splits={num_splits})"
    assert torch.isnan(out[1].float()).all(), f"{what}: its out is not NaN"
    assert torch.isnan(lse[1]).all(), f"{what}: its lse is not NaN"
    keep = [0, 2, 3]
    kw_keep = {k: (v[keep] if k in ("topk_length",) and v is not None else v) for k, v in kw.items()}
    floor = rounding_floor(precision, q[keep], cache=cache, idx=idx[keep], kw=kw_keep, ref_out=ref_out[keep])
    check_against_reference(out[keep], lse[keep], ref_out[keep], ref_lse[keep], floor=floor, seed=seed,
                            what=f"{precision} splits={num_splits} {case} the tokens without the NaN entry")


INTEGER_ROUTE_CASE = Case(T=6, H=32, topk=256, extra_topk=128, lengths="random", extra_lengths="random", sink="mixed",
                          invalid=0.1, spread=8)


@pytest.mark.parametrize("kv_format,precision", [("model1_fp8", "f16"), ("model1_nvfp4", "f16"),
                                                 ("model1_fp8", "bf16")])
@pytest.mark.parametrize("head_groups,num_splits", [(1, 1), (2, 4)])
def test_the_integer_conversion_gives_the_conversion_instructions_bits(kv_format, precision, head_groups, num_splits):
    """sm_80 / sm_86 turn e4m3 and e2m1 bytes into f16 by integer operations (the values
    x 2**-8, e2m1 x 2**-14: ``warp_ops.OperandConversion``), which the kernels take back
    exactly; sm_89 by the conversion instruction. The sm_80 and sm_89 profiles on this GPU
    (both without PDL), planned with the same head groups, splits and register bound, write
    the same bits: scaling every product by a power of two commutes with each rounding. So
    the integer route is the instruction's to the bit, subnormal f16 operands included (the
    tensor cores keep them). Runs in the default suite, no ``DSV4_MLA_ARCH_PROFILE`` needed."""
    from cute_kernels.arch import PROFILES
    from dispatch.runtime.plan import DecodePlan

    own = gpu_target().isa  # the GPU's own target (under a profile too)
    profiles = [f"sm_80_on_{own}", f"sm_89_on_{own}"]
    if not all(p in PROFILES for p in profiles):
        pytest.skip(f"this GPU ({own}) runs no sm_80 profile")
    device = torch.device("cuda")
    case = dataclasses.replace(INTEGER_ROUTE_CASE, kv_format=kv_format)
    seed = seed_for(f"integer route {precision} {case} {head_groups} {num_splits}")
    q, cache, idx, kw = build_inputs(case, device, seed)
    props = torch.cuda.get_device_properties(device)
    overrides = PlanOverrides(head_groups=head_groups, num_splits=num_splits, two_ctas_per_sm=False)
    results = []
    for target in profiles:
        out = torch.full((case.T, case.H, 512), math.nan, dtype=torch.bfloat16, device=device)
        lse = torch.full((case.T, case.H), math.nan, dtype=torch.float32, device=device)
        call = validate_call(q, cache, idx, out=out, lse=lse, precision=precision, for_plan=True,
                             _target=(target, props.multi_processor_count, props.shared_memory_per_multiprocessor),
                             **kw)
        plan = DecodePlan(call, overrides)
        assert [v.arch for v in plan.variants] == [target] * len(plan.variants)
        tensors = {k: v for k, v in kw.items() if k not in ("sm_scale", "kv_format", "extra_kv_format")}
        plan.run(q, cache, idx, out=out, lse=lse, scratch=plan.new_scratch(), sm_scale=kw["sm_scale"], **tensors)
        results.append((out, lse))
    torch.cuda.synchronize()
    (out80, lse80), (out89, lse89) = results
    assert torch.equal(out80, out89) and torch.equal(lse80, lse89), \
        f"[seed {seed}] the integer route's bits differ from the conversion instruction's ({case})"
    check_case(case, precision, seed, [(out80, lse80)], q, cache, idx, kw,
               f"{precision} integer route groups={head_groups} splits={num_splits}")
