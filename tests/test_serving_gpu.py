"""Serving-engine readiness on a CUDA GPU: planned runs, CUDA graphs, torch.compile, adapters, soak.

Every result is checked against the float64 reference (``tests/tolerances.py``); planned and
graph-replayed runs are also compared bit for bit with the one-shot call on the same inputs
(the same kernels must give the same bits). Each test draws its inputs from a fixed seed.
"""

from __future__ import annotations

import math

import pytest
import torch

from cute_kernels.sparse_mla_decode.reference import reference_decode
from dispatch import plan_sparse_mla_decode, sparse_mla_decode
from dispatch.engines.flashinfer_dsv4 import trtllm_batch_decode_sparse_mla_dsv4
from dispatch.engines.flashinfer_mla import trtllm_batch_decode_with_kv_cache_mla
from dispatch.engines.flashmla import flash_mla_with_kvcache
from dispatch.runtime.lse import convert_lse
from dispatch.tools.sample_inputs import INT32_MAX, INT32_MIN, make_cache, make_indices
from tests.tolerances import LSE_TOL, check_against_reference, out_error_and_bound, rounding_floor, seed_for

pytestmark = pytest.mark.gpu
DEV = "cuda"
SCALE_REFUSED = r"sm_scale must be a real Python number whose product with log2\(e\) is 0 or a normal float32"


def _gen(name: str) -> tuple[torch.Generator, int]:
    seed = seed_for(name)
    return torch.Generator().manual_seed(seed), seed


def _check(out, lse, q, cache, idx, kw, seed, what="", precision="f16"):
    """out / lse (natural lse, [T, H, 512] / [T, H]) against the reference of these inputs."""
    ref_out, ref_lse = reference_decode(q, cache, idx, **kw)
    floor = rounding_floor(precision, q, cache=cache, idx=idx, kw=kw, ref_out=ref_out)
    return check_against_reference(out, lse, ref_out, ref_lse, floor=floor, seed=seed, what=what)


def _inputs(T=8, H=16, topk=192, extra_topk=512, *, gen, lengths=True, sink=True):
    cache = make_cache(64, 64, device=DEV, gen=gen)
    extra = make_cache(300, 2, device=DEV, gen=gen)
    kw = dict(extra_kv_cache=extra,
              extra_indices=make_indices(T, extra_topk, 600, device=DEV, invalid_frac=0.1, gen=gen))
    if lengths:
        kw["topk_length"] = torch.randint(0, topk + 1, (T,), generator=gen).int().to(DEV)
        kw["extra_topk_length"] = torch.randint(0, extra_topk + 1, (T,), generator=gen).int().to(DEV)
    if sink:
        kw["attn_sink"] = (torch.randn(H, generator=gen) + 3).to(DEV)
    q = torch.randn(T, H, 512, generator=gen).bfloat16().to(DEV)
    idx = make_indices(T, topk, 64 * 64, device=DEV, invalid_frac=0.1, gen=gen)
    return q, cache, idx, kw


def _refill(q, idx, kw, gen):
    """New values in the same tensors (what a serving step does between replays)."""
    q.copy_(torch.randn(q.shape, generator=gen).bfloat16())
    idx.copy_(make_indices(idx.shape[0], idx.shape[1], 64 * 64, device=DEV, invalid_frac=0.1, gen=gen))
    if "topk_length" in kw:
        kw["topk_length"].copy_(torch.randint(0, idx.shape[1] + 1, (idx.shape[0],), generator=gen).int())


def _planned(T, name):
    """Inputs for T tokens and 16 heads (seeded by ``name``), outputs, and a plan for them."""
    gen, seed = _gen(name)
    q, cache, idx, kw = _inputs(T=T, gen=gen)
    out = torch.empty(T, 16, 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(T, 16, device=DEV)
    return gen, seed, q, cache, idx, kw, out, lse, plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, **kw)


@pytest.mark.parametrize("T", [1, 300])  # several splits + merge, and one split (final mode)
def test_plan_run_equals_one_shot(T):
    gen, seed = _gen(f"plan run {T}")
    q, cache, idx, kw = _inputs(T=T, gen=gen)
    out = torch.full((T, 16, 512), math.nan, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((T, 16), math.nan, device=DEV)
    plan = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, **kw)
    scratch = plan.new_scratch()
    plan.run(q, cache, idx, out=out, lse=lse, scratch=scratch, **kw)
    ref_out, ref_lse = sparse_mla_decode(q, cache, idx, **kw)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    _check(out, lse, q, cache, idx, kw, seed)


def test_plan_run_refuses_a_different_layout():
    q, cache, idx, kw = _inputs(T=1, gen=_gen("refuses layout")[0])  # several splits: the plan needs scratch
    out, lse = torch.empty(1, 16, 512, dtype=torch.bfloat16, device=DEV), torch.empty(1, 16, device=DEV)
    plan = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, **kw)
    assert plan.scratch_bytes > 0
    scratch = plan.new_scratch()
    q2 = torch.randn(2, 16, 512, device=DEV).bfloat16()
    with pytest.raises(ValueError, match="the plan was built for shape"):
        plan.run(q2, cache, idx, out=out, lse=lse, scratch=scratch, **kw)
    without_sink = {k: v for k, v in kw.items() if k != "attn_sink"}
    with pytest.raises(ValueError, match="attn_sink is required"):
        plan.run(q, cache, idx, out=out, lse=lse, scratch=scratch, **without_sink)
    plan_no_sink = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, **without_sink)
    with pytest.raises(ValueError, match="not part of the planned call"):
        plan_no_sink.run(q, cache, idx, out=out, lse=lse, scratch=plan_no_sink.new_scratch(), **kw)
    with pytest.raises(ValueError, match="scratch must be"):
        plan.run(q, cache, idx, out=out, lse=lse, scratch=None, **kw)


@pytest.mark.parametrize("T", [1, 300])
def test_bound_run_follows_the_values_of_its_tensors(T):
    gen, seed, q, cache, idx, kw, out, lse, plan = _planned(T, f"bound run {T}")
    bound = plan.bind(q, cache, idx, out=out, lse=lse, scratch=plan.new_scratch(), sm_scale=0.05, **kw)
    graph = None
    for step in range(3):
        _refill(q, idx, kw, gen)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        if step < 2:
            result = bound.run()
            assert result[0] is out and result[1] is lse
        else:  # captured, then replayed with the values of this step
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                bound.run()
            out.fill_(math.nan)
            graph.replay()
        eager_out, eager_lse = sparse_mla_decode(q, cache, idx, sm_scale=0.05, **kw)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    _check(out, lse, q, cache, idx, dict(kw, sm_scale=0.05), seed)


def test_bind_refuses_a_different_layout():
    q, cache, idx, kw = _inputs(T=1, gen=_gen("bind refuses")[0])
    out, lse = torch.empty(1, 16, 512, dtype=torch.bfloat16, device=DEV), torch.empty(1, 16, device=DEV)
    plan = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, **kw)
    with pytest.raises(ValueError, match=r"DecodePlan.bind: q has shape \[1, 16, 256\]"):
        plan.bind(q[..., :256], cache, idx, out=out, lse=lse, scratch=plan.new_scratch(), **kw)
    with pytest.raises(ValueError, match="DecodePlan.bind: scratch must be"):
        plan.bind(q, cache, idx, out=out, lse=lse, **kw)
    with pytest.raises(ValueError, match=SCALE_REFUSED):
        plan.bind(q, cache, idx, out=out, lse=lse, scratch=plan.new_scratch(), sm_scale=math.inf, **kw)


@pytest.mark.parametrize("T", [4, 300])
def test_cuda_graph_replay_with_new_values_and_padding(T):
    gen, seed, q, cache, idx, kw, out, lse, plan = _planned(T, f"graph replay {T}")
    scratch = plan.new_scratch()
    plan.run(q, cache, idx, out=out, lse=lse, scratch=scratch, **kw)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, cache, idx, out=out, lse=lse, scratch=scratch, **kw)
    for _ in range(3):
        _refill(q, idx, kw, gen)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        eager_out, eager_lse = sparse_mla_decode(q, cache, idx, **kw)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    # a padded batch: only the first `valid` tokens are real, the rest have length 0 in both lists
    valid = max(T // 2, 1)
    kw["topk_length"][valid:] = 0
    kw["extra_topk_length"][valid:] = 0
    out.fill_(math.nan)
    graph.replay()
    eager_out, eager_lse = sparse_mla_decode(q, cache, idx, **kw)  # eager on the same padded batch
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert (out[valid:] == 0).all() and torch.isposinf(lse[valid:]).all()
    sub = {k: (v[:valid] if k in ("topk_length", "extra_topk_length", "extra_indices") else v) for k, v in kw.items()}
    _check(out[:valid], lse[:valid], q[:valid], cache, idx[:valid], sub, seed)


def test_one_shot_call_can_be_captured():
    gen, seed = _gen("one-shot capture")
    q, cache, idx, kw = _inputs(T=2, gen=gen)
    sparse_mla_decode(q, cache, idx, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_mla_decode(q, cache, idx, **kw)
    q.copy_(torch.randn(q.shape, generator=gen).bfloat16())
    graph.replay()
    ref_out, ref_lse = sparse_mla_decode(q, cache, idx, **kw)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    _check(out, lse, q, cache, idx, kw, seed)


@pytest.mark.parametrize("precision", [None, pytest.param("fp8", marks=pytest.mark.e4m3_mma)])
def test_torch_compile_fullgraph(precision):
    gen, seed = _gen(f"torch.compile {precision}")
    q, cache, idx, kw = _inputs(T=4, gen=gen)
    scale = 0.06

    def layer(q, cache, idx, lens, sink, extra, e_idx, e_lens):
        return torch.ops.dsv4_mla.sparse_mla_decode(q * 2.0, cache, idx, scale, lens, sink, extra, e_idx, e_lens,
                                                    precision)

    args = (q, cache, idx, kw["topk_length"], kw["attn_sink"], kw["extra_kv_cache"], kw["extra_indices"],
            kw["extra_topk_length"])
    out, lse = torch.compile(layer, fullgraph=True)(*args)
    _check(out, lse, q * 2.0, cache, idx, dict(kw, sm_scale=scale), seed, "torch.compile", precision or "f16")


def test_flash_mla_adapter_conventions():
    B, S, H = 3, 2, 16
    gen, seed = _gen("flash_mla adapter")
    q, cache, idx, kw = _inputs(T=B * S, H=H, gen=gen)
    out, lse = flash_mla_with_kvcache(
        q.view(B, S, H, 512), cache, None, None, 512, None, None, softmax_scale=0.07, is_fp8_kvcache=True,
        indices=idx.view(B, S, -1), attn_sink=kw["attn_sink"], extra_k_cache=kw["extra_kv_cache"],
        extra_indices_in_kvcache=kw["extra_indices"].view(B, S, -1), topk_length=kw["topk_length"].view(B, S),
        extra_topk_length=kw["extra_topk_length"].view(B, S))
    assert out.shape == (B, S, H, 512) and lse.shape == (B, H, S)  # FlashMLA's layouts
    _check(out.reshape(B * S, H, 512), lse.transpose(1, 2).reshape(B * S, H), q, cache, idx,
           dict(kw, sm_scale=0.07), seed, "flash_mla_with_kvcache")


def test_flashinfer_adapter_conventions():
    T, H = 6, 16
    gen, seed = _gen("flashinfer adapter")
    q, cache, idx, kw = _inputs(T=T, H=H, gen=gen)
    idx[0] = -1
    kw["extra_indices"][0] = -1  # token 0 selects nothing
    out, lse = trtllm_batch_decode_sparse_mla_dsv4(
        q, cache, None, idx, compressed_kv_cache=kw["extra_kv_cache"], swa_topk_lens=kw["topk_length"],
        bmm1_scale=0.05, sinks=kw["attn_sink"], kv_layout="NHD", extra_sparse_indices=kw["extra_indices"],
        extra_sparse_topk_lens=kw["extra_topk_length"], return_lse=True)
    ref_kw = dict(kw, sm_scale=0.05)
    ref_out, ref_lse = reference_decode(q, cache, idx, **ref_kw)
    # log2 with the sink folded in: log2(exp(lse) + exp(sink)), the empty token's just the sink
    want = convert_lse(ref_lse, kw["attn_sink"], "log2_with_sink")
    assert torch.allclose(lse.double(), want, rtol=LSE_TOL, atol=LSE_TOL), f"[seed {seed}] lse"
    assert torch.allclose(lse[0].double(), kw["attn_sink"].double() * math.log2(math.e), rtol=LSE_TOL)
    # the same call with the lse in this library's convention: out and lse against the reference
    out_nat, lse_nat = trtllm_batch_decode_sparse_mla_dsv4(
        q, cache, None, idx, compressed_kv_cache=kw["extra_kv_cache"], swa_topk_lens=kw["topk_length"],
        bmm1_scale=0.05, sinks=kw["attn_sink"], kv_layout="NHD", extra_sparse_indices=kw["extra_indices"],
        extra_sparse_topk_lens=kw["extra_topk_length"], return_lse=True, lse_convention="natural")
    assert torch.equal(out_nat, out)
    _check(out_nat, lse_nat, q, cache, idx, ref_kw, seed, "trtllm_batch_decode_sparse_mla_dsv4")


@pytest.mark.parametrize("precision", ["bf16", "f16", pytest.param("fp8", marks=pytest.mark.e4m3_mma)])
def test_out_of_range_indices_are_never_read(precision):
    gen, seed = _gen(f"out of range {precision}")
    cache = make_cache(8, 64, device=DEV, gen=gen)
    n = 8 * 64
    bad = torch.tensor([-1, -2, INT32_MIN, INT32_MAX, n, n + 1], dtype=torch.int32)
    idx = torch.cat([bad.repeat(4, 1), torch.randint(0, n, (4, 10), generator=gen).int()], dim=1).to(DEV)
    idx[3, 6:] = -1  # token 3: only invalid entries
    q = torch.randn(4, 8, 512, generator=gen).bfloat16().to(DEV)
    out, lse = sparse_mla_decode(q, cache, idx, precision=precision)
    _check(out, lse, q, cache, idx, {}, seed, "out of range", precision)
    assert torch.isposinf(lse[3]).all() and (out[3] == 0).all()


def test_soak_10000_calls():
    gen, seed = _gen("soak")
    shapes = [(T, H, topk, extra) for T, H, topk, extra in
              [(1, 16, 128, 0), (2, 8, 192, 512), (5, 64, 256, 0), (7, 128, 128, 64), (3, 4, 100, 1024),
               (16, 16, 512, 0), (1, 32, 1152, 512), (65, 16, 64, 0)]]
    pool = []
    for T, H, topk, extra in shapes:
        q, cache, idx, kw = _inputs(T=T, H=H, topk=topk, extra_topk=max(extra, 1), gen=gen,
                                    lengths=bool(T % 2), sink=bool(H % 32))
        if extra == 0:
            for k in ("extra_kv_cache", "extra_indices", "extra_topk_length"):
                kw.pop(k, None)
        pool.append((q, cache, idx, kw))
    for i in range(len(pool)):  # warm-up: compile/plan every shape once
        sparse_mla_decode(pool[i][0], pool[i][1], pool[i][2], **pool[i][3])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for i in range(10_000):
        q, cache, idx, kw = pool[torch.randint(0, len(pool), (1,), generator=gen).item()]
        out, lse = sparse_mla_decode(q, cache, idx, **kw)
        if i % 500 == 0:
            _check(out, lse, q, cache, idx, kw, seed, f"soak call {i}")
            q.copy_(torch.randn(q.shape, generator=gen).bfloat16())
    torch.cuda.synchronize()
    del out, lse
    assert torch.cuda.memory_allocated() <= base, "device memory grew over the soak"


def test_core_api_lse_convention_is_explicit():
    gen, seed = _gen("lse convention")
    q, cache, idx, kw = _inputs(T=3, gen=gen)
    out, lse = sparse_mla_decode(q, cache, idx, lse_convention="log2_with_sink", **kw)
    ref_out, ref_lse = reference_decode(q, cache, idx, **kw)
    want = convert_lse(ref_lse, kw["attn_sink"], "log2_with_sink")
    assert torch.allclose(lse.double(), want, rtol=LSE_TOL, atol=LSE_TOL), f"[seed {seed}] lse"
    natural_out, natural_lse = sparse_mla_decode(q, cache, idx, **kw)
    assert torch.equal(out, natural_out)
    _check(natural_out, natural_lse, q, cache, idx, kw, seed, "natural lse")



# ---------------------------------------------------------------------- the FP32-scale formats
def _fp32_inputs(kv_format, T, H, topk, *, gen, row_stride=None, sink=False):
    """A cache of ``kv_format`` as vLLM's writer fills it (FP32 scales over several binades, not
    powers of two), a [T, H, d_qk] q and slots (a tenth invalid), lengths, an optional sink."""
    d_qk = {"v32_fp8": 576, "glm_nope_fp8": 512}[kv_format]
    cache = make_cache(64, 64, device=DEV, kv_format=kv_format, row_stride=row_stride, writer="vllm",
                       scale_spread=3.0, gen=gen)
    q = torch.randn(T, H, d_qk, generator=gen).bfloat16().to(DEV)
    idx = make_indices(T, topk, 64 * 64, device=DEV, invalid_frac=0.1, gen=gen)
    kw = {"topk_length": torch.randint(0, topk + 1, (T,), generator=gen).int().to(DEV)}
    if sink:
        kw["attn_sink"] = (torch.randn(H, generator=gen) + 3).to(DEV)
    return q, cache, idx, kw


@pytest.mark.parametrize("T", [1, 300])
@pytest.mark.parametrize("kv_format,row_stride", [("v32_fp8", None), ("glm_nope_fp8", 528),
                                                  ("glm_nope_fp8", 656)])
def test_fp32_scale_formats_planned_and_replayed(kv_format, row_stride, T):
    """One-shot, planned and graph-replayed calls on each FP32-scale format (GLM-5.3 in its own
    rows and in 656-byte pool rows: the row stride a runtime argument) give the same bits, and
    match the reference of that format."""
    gen, seed = _gen(f"fp32 formats {kv_format} {row_stride} {T}")
    q, cache, idx, kw = _fp32_inputs(kv_format, T, 32, 256, gen=gen, row_stride=row_stride, sink=True)
    out = torch.full((T, 32, 512), math.nan, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((T, 32), math.nan, device=DEV)
    plan = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, kv_format=kv_format, **kw)
    assert plan.kv_format == kv_format and all(kv_format in v.name for v in plan.variants if v.kind == "partial")
    scratch = plan.new_scratch()
    plan.run(q, cache, idx, out=out, lse=lse, scratch=scratch, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, cache, idx, out=out, lse=lse, scratch=scratch, **kw)
    _refill(q, idx, kw, gen)
    out.fill_(math.nan)
    graph.replay()
    one_out, one_lse = sparse_mla_decode(q, cache, idx, kv_format=kv_format, **kw)
    assert torch.equal(out, one_out) and torch.equal(lse, one_lse)
    _check(out, lse, q, cache, idx, dict(kw, kv_format=kv_format), seed, f"{kv_format} rows {row_stride}")


def test_flashinfer_mla_adapter_serves_vllms_v32_call():
    """The call vLLM's SM120 sparse MLA backend makes for DeepSeek-V3.2 / GLM-5.x, word for word
    (q [T, H, 576] as [T, 1, H, 576], the [blocks, P, 656] cache as HND, [T, 1, topk] slots, no
    lengths), with the lse asked for: base 2 by default, natural with ``return_lse_base``."""
    T, H, topk = 5, 64, 2048
    gen, seed = _gen("flashinfer mla v32")
    q, cache, idx, _ = _fp32_inputs("v32_fp8", T, H, topk, gen=gen)
    vllm_cache = cache.squeeze(2)  # vLLM's [num_blocks, block_size, 656] pool
    out = torch.empty(T, 1, H, 512, dtype=torch.bfloat16, device=DEV)
    result, lse2 = trtllm_batch_decode_with_kv_cache_mla(
        query=q.unsqueeze(1), kv_cache=vllm_cache.unsqueeze(1), workspace_buffer=None, qk_nope_head_dim=128,
        kv_lora_rank=512, qk_rope_head_dim=64, block_tables=idx.unsqueeze(1), seq_lens=None, max_seq_len=topk,
        out=out, bmm1_scale=0.04, bmm2_scale=1.0, sparse_mla_top_k=topk, kv_scale_format="pow2_fp32",
        return_lse=True)
    assert result is out and lse2.shape == (T, H)
    ref_kw = dict(sm_scale=0.04, kv_format="v32_fp8")
    ref_out, ref_lse = reference_decode(q, cache, idx, **ref_kw)
    assert torch.allclose(lse2.double(), convert_lse(ref_lse, None, "log2_with_sink"), rtol=LSE_TOL, atol=LSE_TOL)
    natural = torch.empty(T, 1, H, device=DEV)
    _, lse_e = trtllm_batch_decode_with_kv_cache_mla(
        q.unsqueeze(1), vllm_cache, None, 128, 512, 64, idx.unsqueeze(1), None, topk, sparse_mla_top_k=topk,
        bmm1_scale=0.04, kv_scale_format="arbitrary_fp32", return_lse=True, lse=natural, return_lse_base="basee")
    assert lse_e is natural
    _check(result.squeeze(1), natural.squeeze(1), q, cache, idx, ref_kw, seed, "trtllm_batch_decode_with_kv_cache_mla")


def test_flashinfer_mla_adapter_serves_glm53_rope_free_rows():
    """GLM-5.3's rope-free rows (512 + 0) in vLLM's 656-byte pool rows, lengths per token."""
    T, H, topk = 3, 32, 2176
    gen, seed = _gen("flashinfer mla glm53")
    q, cache, idx, kw = _fp32_inputs("glm_nope_fp8", T, H, topk, gen=gen, row_stride=656)
    out, lse = trtllm_batch_decode_with_kv_cache_mla(
        q.unsqueeze(1), cache.squeeze(2), None, 256, 512, 0, idx.unsqueeze(1), kw["topk_length"], topk,
        sparse_mla_top_k=topk, bmm1_scale=0.05, kv_scale_format="arbitrary_fp32", return_lse=True,
        lse_convention="natural")
    _check(out.squeeze(1), lse, q, cache, idx, dict(kw, sm_scale=0.05, kv_format="glm_nope_fp8"), seed,
           "GLM-5.3 adapter")


def test_flash_mla_adapter_serves_v32():
    B, S, H, topk = 2, 2, 16, 512
    gen, seed = _gen("flash_mla v32")
    q, cache, idx, kw = _fp32_inputs("v32_fp8", B * S, H, topk, gen=gen)
    out, lse = flash_mla_with_kvcache(q.view(B, S, H, 576), cache, None, None, 512, None, None, softmax_scale=0.06,
                                      is_fp8_kvcache=True, indices=idx.view(B, S, topk),
                                      topk_length=kw["topk_length"].view(B, S))
    assert out.shape == (B, S, H, 512) and lse.shape == (B, H, S)
    _check(out.reshape(B * S, H, 512), lse.transpose(1, 2).reshape(B * S, H), q, cache, idx,
           dict(kw, sm_scale=0.06, kv_format="v32_fp8"), seed, "flash_mla_with_kvcache v32")


def test_one_shot_plan_cache_never_mixes_layouts():
    """The one-shot call reuses a validated plan only for the same layout (``dispatch.runtime.plan_cache``):
    a tensor that differs in a stride, a dtype, a device or an optional input gets its own
    plan or its refusal, and every result matches the reference."""
    from dispatch.api import ONE_SHOT_PLANS, clear_plan_cache
    from dispatch.policy.call_metadata import InvalidDecodeInput

    gen, seed = _gen("one-shot plan cache")
    q, cache, idx, kw = _inputs(T=3, H=16, gen=gen, lengths=False)
    clear_plan_cache()
    out, lse = sparse_mla_decode(q, cache, idx, **kw)
    assert len(ONE_SHOT_PLANS) == 1
    _refill(q, idx, kw, gen)  # new values, same tensors: the cached plan
    out, lse = sparse_mla_decode(q, cache, idx, **kw)
    assert len(ONE_SHOT_PLANS) == 1
    _check(out, lse, q, cache, idx, kw, seed, "cached plan, new values")
    # q with padded rows (another stride): its own plan
    wide = torch.empty(3, 16, 1024, dtype=torch.bfloat16, device=DEV)[..., :512]
    wide.copy_(q)
    out2, lse2 = sparse_mla_decode(wide, cache, idx, **kw)
    assert len(ONE_SHOT_PLANS) == 2 and torch.equal(out2, out) and torch.equal(lse2, lse)
    # an optional input more: its own plan
    lens = torch.randint(0, idx.shape[1] + 1, (3,), generator=gen).int().to(DEV)
    out3, lse3 = sparse_mla_decode(q, cache, idx, topk_length=lens, **kw)
    assert len(ONE_SHOT_PLANS) == 3
    _check(out3, lse3, q, cache, idx, dict(kw, topk_length=lens), seed, "cached plan, lengths added")
    # another dtype or device, or a misaligned address of the same layout: refused, never served by a cached plan
    with pytest.raises(InvalidDecodeInput, match="indices must be int32"):
        sparse_mla_decode(q, cache, idx.long(), **kw)
    with pytest.raises(InvalidDecodeInput, match="is on cpu"):
        sparse_mla_decode(q, cache, idx.cpu(), **kw)
    shifted = torch.empty(3 * 16 * 512 + 1, dtype=torch.bfloat16, device=DEV)[1:].view(3, 16, 512)
    shifted.copy_(q)
    with pytest.raises(InvalidDecodeInput, match="data pointer must be 16-byte aligned"):
        sparse_mla_decode(shifted, cache, idx, **kw)
    with pytest.raises(InvalidDecodeInput, match=SCALE_REFUSED):
        sparse_mla_decode(q, cache, idx, sm_scale=math.nan, **kw)
    assert len(ONE_SHOT_PLANS) == 3
    # a side stream has its own scratch: the same results
    assert all(e.plan.scratch_bytes for e in ONE_SHOT_PLANS._plans.values())  # split plans: scratch in use
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out4, lse4 = sparse_mla_decode(q, cache, idx, **kw)
    stream.synchronize()
    assert torch.equal(out4, out) and torch.equal(lse4, lse)
    held = [kind for (kind, _, _) in ONE_SHOT_PLANS._buffers]
    assert held.count("scratch") == 2  # one scratch buffer per stream


def test_outputs_overlapping_an_input_are_refused_on_every_path():
    """An ``out`` (or ``lse``) whose memory overlaps an input is refused before any launch by
    ``plan.run`` and ``bind`` (the addresses are new on every call) and by a repeated one-shot
    call whose layout is cached (its plan declines, the full validation refuses), and the
    tensors are left as they were."""
    from dispatch import InvalidDecodeInput

    gen, _ = _gen("overlapping outputs")
    q, cache, idx, kw = _inputs(T=4, H=16, gen=gen)
    out = torch.empty(4, 16, 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(4, 16, dtype=torch.float32, device=DEV)
    plan = plan_sparse_mla_decode(q, cache, idx, out=out, lse=lse, **kw)
    scratch = plan.new_scratch()
    q_before = q.clone()
    for fn in (plan.run, plan.bind):
        with pytest.raises(ValueError, match="out overlaps q in memory"):
            fn(q, cache, idx, out=q, lse=lse, scratch=scratch, **kw)
    sparse_mla_decode(q, cache, idx, out=out, lse=lse, **kw)  # the layout, validated and cached
    with pytest.raises(InvalidDecodeInput, match="out overlaps q in memory"):
        sparse_mla_decode(q, cache, idx, out=q, lse=lse, **kw)
    wide = torch.empty(4 * 16 * 512 * 2 // 4 + 64, dtype=torch.float32, device=DEV)  # lse inside out's bytes
    with pytest.raises(InvalidDecodeInput, match="out overlaps lse in memory"):
        sparse_mla_decode(q, cache, idx, out=wide[:4 * 16 * 256].view(torch.bfloat16).view(4, 16, 512),
                          lse=wide[64:128].view(4, 16), **kw)
    torch.cuda.synchronize()
    assert torch.equal(q, q_before), "a refused call wrote into q"


def test_plan_cache_memory_stays_within_its_cap():
    """vLLM's call (no lse wanted) over layouts of 745..1000 tokens at 128 heads, prefill
    chunks' sizes: the cache keeps one lse buffer and one scratch buffer per stream, never more
    bytes than its cap, and says so (``plan_cache_info``); the device memory the sequence
    leaves allocated is those buffers' and nothing per layout (an lse kept per layout held
    109 MiB after the whole range); the results stay right."""
    from dispatch import clear_plan_cache, plan_cache_info

    clear_plan_cache()
    gen, seed = _gen("plan cache memory")
    H, topk = 128, 128
    cache = make_cache(64, 64, device=DEV, gen=gen)

    def run_sequence():  # its tensors are freed when it returns: what stays is the cache's
        for n, T in enumerate(range(745, 1001, 17)):
            q = torch.randn(T, H, 512, generator=gen).bfloat16().to(DEV)
            idx = make_indices(T, topk, 64 * 64, device=DEV, invalid_frac=0.1, gen=gen)
            out = trtllm_batch_decode_sparse_mla_dsv4(q, cache, None, idx, bmm1_scale=0.05, kv_layout="NHD",
                                                      out=torch.empty(T, H, 512, dtype=torch.bfloat16, device=DEV))
            info = plan_cache_info()
            assert info["buffer_bytes"] <= info["byte_cap"] and info["entries"] == n + 1, info
            assert info["lse_bytes"] <= T * H * 4, info  # one lse buffer, the largest need so far
            if n % 5 == 0:
                sub = slice(0, T, max(1, T // 8))
                ref_out, _ = reference_decode(q[sub], cache, idx[sub], sm_scale=0.05)
                floor = rounding_floor("f16", q[sub], cache=cache, idx=idx[sub], kw=dict(sm_scale=0.05),
                                       ref_out=ref_out)
                rel, bound = out_error_and_bound(out[sub].cpu(), ref_out.cpu(), floor.cpu())
                assert (rel <= bound).all(), f"[seed {seed}] T={T}: out error {rel.max().item()} above its bound"

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    run_sequence()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    info = plan_cache_info()
    assert info["buffers"] <= 2 and info["entries"] == 16, info
    # the caching allocator rounds each block up to 512 bytes
    assert held <= min(info["buffer_bytes"] + 512 * info["buffers"], info["byte_cap"]), (held, info)
    clear_plan_cache()
    assert plan_cache_info()["buffer_bytes"] == 0
