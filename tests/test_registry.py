"""The deployment registry (CPU): plans built from its calls' tensors select what
``registry_calls`` and ``registry_variants`` list, every deployment call of two formats selects
variants of the variant space, and MODEL1's decisions are those recorded before other formats
existed."""

import hashlib

import pytest
import torch

from cute_kernels.arch import arch_facts
from cute_kernels.sparse_mla_decode.config import MergeConfig, merge_batch_for
from cute_kernels.sparse_mla_decode.kv_format import FORMATS
from dispatch.policy.call_metadata import DecodeMetadata
from dispatch.runtime.plan import DecodePlan
from dispatch.policy.registry import (
    DEPLOYMENT_NUM_TOKENS, DEPLOYMENT_SHAPES, DEPLOYMENT_SM_COUNTS, deployment_calls, registry_calls, registry_variants,
)
from dispatch.policy.selection import select_kernels
from dispatch.policy.precision import precisions_for
from dispatch.policy.variant_space import KernelVariant, variant_space, variants_for
from dispatch.tools.sample_inputs import make_cache
from tests.dispatch_inputs import MODEL1, _stub_kernels


def _model1_decisions(arch: str) -> tuple:
    """(calls, digest of every MODEL1 registry call's decisions, variants, digest of their names
    without the format): what the dispatch chose for MODEL1 when it was the only format. The
    calls are those of MODEL1 caches alone (main and any extra cache MODEL1): a call whose
    extra cache is NVFP4 runs a kernel per list (``test_a_mixed_call_*``)."""
    h, n = hashlib.sha256(), 0
    for precision in precisions_for(arch):
        for md, splits, groups, two in registry_calls(precision, arch):
            if md.kv_format == MODEL1 and md.extra_kv_format is None:
                h.update(repr((precision, md.num_tokens, md.num_heads, md.topk, md.page_block_size, md.extra_topk,
                               md.extra_page_block_size, md.has_topk_length, md.has_extra_topk_length, md.has_sink,
                               splits, groups, two)).encode())
                n += 1
    names = sorted(v.name.replace(f"_{MODEL1}", "") for v in registry_variants(arch)
                   if v.kind == "merge" or v.config.kv_format == MODEL1)
    return n, h.hexdigest()[:16], len(names), hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def test_model1_decisions_are_those_of_the_single_format_dispatch():
    """Adding formats changed no MODEL1 decision: the head groups, splits and register bound of
    every MODEL1 deployment call, and the MODEL1 registry (names less the format), hash to
    what the dispatch gave before formats existed (recorded from it). The names are the whole
    registry's: no call of another format, nor of two formats (a MODEL1 cache beside an NVFP4
    one), adds a MODEL1 or merge kernel. A deliberate change of a MODEL1 rule updates these
    numbers."""
    assert _model1_decisions("sm_120a") == (66048, "2eff9be7b900cebd", 100, "e0c64cd552e91f9f")
    assert _model1_decisions("sm_90a") == (49536, "fbca87e6fe9efa8d", 87, "73abb3eacbcaef98")


def _deployment_call_inputs(md: DecodeMetadata, caches: dict) -> dict:
    """CPU inputs of the call ``md`` describes, as ``validate_call`` takes them. q and the index
    lists are broadcast views of one row (the layout checks pass them; a plan never reads
    them), out and lse uninitialized (pages never touched), so that a 4096-token call costs
    almost no memory; ``caches``: by (format, page). An
    extra cache of another format is named (``extra_kv_format``), as its width may not say it."""
    fmt = FORMATS[md.kv_format]
    T, H = md.num_tokens, md.num_heads

    def cache(page, kv_format=md.kv_format):
        key = (kv_format, page)
        if key not in caches:
            caches[key] = make_cache(2, page, device="cpu", kv_format=kv_format)
        return caches[key]

    def rows(*shape, dtype):
        return torch.zeros(shape[-1], dtype=dtype).expand(*shape)

    kw = dict(q=rows(T, H, md.d_qk, dtype=torch.bfloat16), kv_cache=cache(md.page_block_size),
              indices=rows(T, md.topk, dtype=torch.int32), out=torch.empty(T, H, fmt.d_v, dtype=torch.bfloat16),
              lse=torch.empty(T, H, dtype=torch.float32), kv_format=md.kv_format)
    if md.has_topk_length:
        kw["topk_length"] = torch.zeros(T, dtype=torch.int32)
    if md.has_sink:
        kw["attn_sink"] = torch.zeros(H, dtype=torch.float32)
    if md.extra_topk:
        kw["extra_kv_cache"] = cache(md.extra_page_block_size, md.extra_kv_format or md.kv_format)
        kw["extra_indices"] = rows(T, md.extra_topk, dtype=torch.int32)
        if md.extra_kv_format is not None:
            kw["extra_kv_format"] = md.extra_kv_format
        if md.has_extra_topk_length:
            kw["extra_topk_length"] = torch.zeros(T, dtype=torch.int32)
    return kw


# every 61st deployment call of each (arch, precision): 61 is prime to the grid's strides (24
# token and SM counts per shape and flags), so the sample walks through the tokens, SM counts,
# optional inputs, shapes and formats alike (the test asserts it reaches all of them)
_REGISTRY_SAMPLE_STRIDE = 61


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_registry_is_what_plans_select(monkeypatch, arch):
    """The AOT registry is what the dispatch selects: for a sample of the deployment calls of
    every compute path, a ``DecodePlan`` built as a call builds it (``validate_call`` on CPU
    tensors of that shape, for ``arch``, each SM count and its shared memory per SM) describes
    the call as the registry does, selects what ``registry_calls`` yields for it and launches
    only variants of ``registry_variants(arch)``. Both go through ``select_kernels``, so what
    this checks is the path from a call's tensors to that function's inputs (the metadata, SM
    count, shared memory); the selection itself is pinned by ``test_model1_decisions_*``, and
    is, for a call of one format, ``variants_for``'s, for a call of two formats
    (``DecodeMetadata.mixed``) ``variants_for``'s for each list in split mode, then a merge of
    all their splits."""
    from dispatch.api import validate_call

    _stub_kernels(monkeypatch)
    smem_per_sm = arch_facts(arch).smem_per_sm
    registry = set(registry_variants(arch))
    caches, seen = {}, set()
    for precision in precisions_for(arch):
        calls = zip(deployment_calls(precision, arch), registry_calls(precision, arch))
        for i, ((md, sms), (registry_md, splits, groups, two)) in enumerate(calls):
            if i % _REGISTRY_SAMPLE_STRIDE:
                continue
            assert registry_md == md
            call = validate_call(**_deployment_call_inputs(md, caches), precision=precision, for_plan=True,
                                 _target=(arch, sms, smem_per_sm))
            assert call.launch_metadata == md, (call.launch_metadata, md)
            plan = DecodePlan(call)
            what = (precision, sms, md)
            selection = select_kernels(md, arch, num_sms=sms, smem_per_sm=smem_per_sm, precision=precision)
            assert (plan.num_splits, selection.head_groups, selection.two_ctas_per_sm) == (splits, groups, two), what
            assert plan.split == selection.split and plan.variants == selection.variants, what
            if md.mixed:
                main_md, extra_md = md.list_calls()
                extra = selection.extra
                assert plan.extra_split == extra.split and splits == plan.split.num_splits + extra.split.num_splits
                assert plan.variants == (
                    variants_for(main_md, arch, plan.split.num_splits, groups, precision=precision,
                                 two_ctas_per_sm=two, split_mode=True)[0],
                    variants_for(extra_md, arch, extra.split.num_splits, extra.head_groups, precision=precision,
                                 two_ctas_per_sm=extra.two_ctas_per_sm, split_mode=True)[0],
                    KernelVariant(MergeConfig(has_sink=md.has_sink, split_batch=merge_batch_for(splits)), arch),
                ), what
            else:
                assert plan.extra_split is None and selection.extra is None, what
                assert plan.variants == variants_for(md, arch, splits, groups, precision=precision,
                                                     two_ctas_per_sm=two), what
            assert set(plan.variants) <= registry, what
            seen.update({("format", md.kv_format), ("format", md.extra_kv_format or md.kv_format),
                         ("mixed", md.mixed), ("pair", md.kv_format, md.extra_kv_format), ("precision", precision),
                         ("tokens", md.num_tokens), ("sms", sms), ("len", md.has_topk_length), ("sink", md.has_sink),
                         ("extra", md.extra_topk > 0), ("extra_len", md.has_extra_topk_length),
                         ("splits", splits > 1), ("groups", groups), ("two", two)})
    expected = ({("format", f) for f in FORMATS} | {("precision", p) for p in precisions_for(arch)}
                | {("tokens", t) for t in DEPLOYMENT_NUM_TOKENS} | {("sms", n) for n in DEPLOYMENT_SM_COUNTS}
                | {(flag, b) for flag in ("len", "sink", "extra", "extra_len", "splits", "mixed")
                   for b in (False, True)}
                | {("groups", g) for g in (1, 2)} | {("two", False)}
                | {("pair", s.kv_format, s.extra_kv_format) for s in DEPLOYMENT_SHAPES})
    assert expected <= seen, sorted(expected - seen)
    assert ("two", True) in seen or arch != "sm_90a"  # the H200's bounded "f16" kernels are sampled too


@pytest.mark.parametrize("arch", ["sm_120a", "sm_121a", "sm_90a"])
def test_every_variant_a_mixed_deployment_call_selects_is_in_the_variant_space(arch):
    """Every deployment call of two formats (each registry pairing, every compute path both
    formats have) selects only variants of ``variant_space(arch)``: the AOT build has them."""
    space, smem, pairs = set(variant_space(arch)), arch_facts(arch).smem_per_sm, {}
    for precision in precisions_for(arch):
        for md, sms in deployment_calls(precision, arch):
            if md.mixed:
                variants = select_kernels(md, arch, num_sms=sms, smem_per_sm=smem, precision=precision).variants
                assert len(variants) == 3 and set(variants) <= space, (precision, sms, md)
                pairs[md.kv_format, md.extra_kv_format] = pairs.get((md.kv_format, md.extra_kv_format), 0) + 1
    assert set(pairs) == {(s.kv_format, s.extra_kv_format) for s in DEPLOYMENT_SHAPES if s.extra_kv_format}, pairs
