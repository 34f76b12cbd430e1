"""The engines' call shapes (``dispatch.engines``: FlashMLA's, FlashInfer's and SGLang's; CPU: up to the device
check): the calls vLLM and SGLang make reach the device check, and what an adapter does not
serve is refused by name."""

import pytest
import torch

from cute_kernels.sparse_mla_decode.kv_format import FORMATS, GLM_NOPE_FP8, MODEL1_FP8, V32_FP8
from dispatch import DecodeMetadata, InvalidDecodeInput
from dispatch.engines import flashinfer_dsv4
from dispatch.engines.flashinfer_dsv4 import DSV4_KV_CACHE_FORMATS, trtllm_batch_decode_sparse_mla_dsv4
from dispatch.engines.flashinfer_mla import trtllm_batch_decode_with_kv_cache_mla
from dispatch.engines.flashmla import flash_mla_with_kvcache, flash_mla_with_kvcache_sm120
from dispatch.policy.call_metadata import GENERIC_MODEL_TYPE
from dispatch.tools.sample_inputs import make_cache
from tests.dispatch_inputs import GLM_CACHE, GLM_POOL_CACHE, NVFP4_CACHE, V32_CACHE, V41_CACHE, V41_NVFP4_CACHE, _inputs


def _refused(fn, *args, **kwargs) -> str:
    with pytest.raises(InvalidDecodeInput) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _vllm_v32_call(**overrides):
    """The call vLLM's SM120 sparse MLA backend makes (q [T, H, 576] unsqueezed to one query
    per request, the [num_blocks, P, 656] cache unsqueezed to HND, indices [T, 1, topk])."""
    T, H, topk = 3, 16, 64
    kw = dict(query=torch.randn(T, 1, H, 576).to(torch.bfloat16), kv_cache=V32_CACHE.squeeze(2).unsqueeze(1),
              workspace_buffer=torch.empty(16, dtype=torch.uint8), qk_nope_head_dim=128, kv_lora_rank=512,
              qk_rope_head_dim=64, block_tables=torch.zeros(T, 1, topk, dtype=torch.int32), seq_lens=None,
              max_seq_len=topk, out=torch.empty(T, 1, H, 512, dtype=torch.bfloat16), bmm1_scale=0.1, bmm2_scale=1.0,
              sparse_mla_top_k=topk, kv_scale_format="pow2_fp32")
    kw.update(overrides)
    return kw


def test_flashinfer_mla_adapter_serves_the_vllm_v32_and_glm_calls():
    for scale_format in ("auto", "pow2_fp32", "arbitrary_fp32"):
        text = _refused(trtllm_batch_decode_with_kv_cache_mla, **_vllm_v32_call(kv_scale_format=scale_format))
        assert text.startswith(V32_FP8.model_type + ": num_tokens=3, num_heads=16, topk=64, d_qk=576")
        assert text.endswith("the kernels run on CUDA devices only")
    # a [num_pages, P, 656] cache, lengths per token
    text = _refused(trtllm_batch_decode_with_kv_cache_mla, **_vllm_v32_call(
        kv_cache=V32_CACHE.squeeze(2), seq_lens=torch.full((3,), 5, dtype=torch.int32)))
    assert text.endswith("the kernels run on CUDA devices only")
    # GLM-5.3 rope-free rows in a 656-byte pool: read as GLM-5.3 (the width alone says V3.2)
    glm = _vllm_v32_call(query=torch.randn(3, 1, 16, 512).to(torch.bfloat16), qk_rope_head_dim=0,
                         kv_cache=GLM_POOL_CACHE.squeeze(2).unsqueeze(1), kv_scale_format="arbitrary_fp32",
                         sparse_mla_top_k_lens=torch.full((3,), 5, dtype=torch.int32))
    text = _refused(trtllm_batch_decode_with_kv_cache_mla, **glm)
    assert text.startswith(GLM_NOPE_FP8.model_type + ": num_tokens=3, num_heads=16, topk=64, d_qk=512")
    assert text.endswith("the kernels run on CUDA devices only")


@pytest.mark.parametrize("overrides,message", [
    (dict(qk_rope_head_dim=32), "kv_lora_rank=512, qk_rope_head_dim=32 name no FP32-scale cache format"),
    (dict(kv_scale_format="ue8m0_g32"), "kv_scale_format must be one of ('auto', 'pow2_fp32', 'arbitrary_fp32')"),
    (dict(sparse_mla_top_k=0), "sparse_mla_top_k must be a positive int (dense MLA decode is not served)"),
    (dict(backend="trtllm-gen"), "backend must be 'auto' or 'sparse'"),
    (dict(cum_seq_lens_q=torch.zeros(4, dtype=torch.int32)), "cum_seq_lens_q / max_q_len (ragged query lengths)"),
    (dict(enable_dcp=True), "decode context parallelism"),
    (dict(skip_softmax_threshold_scale_factor=1.0), "skip_softmax_threshold_scale_factor is not served"),
    (dict(uses_shared_paged_kv_idx=False), "separate K/V page indices"),
    (dict(bmm2_scale=2.0), "bmm2_scale must be 1.0"),
    (dict(bmm1_scale=torch.tensor(0.1)), "bmm1_scale must be a real Python number, not a tensor: it would be read"),
    (dict(bmm1_scale="0.1"), "bmm1_scale must be a real Python number"),  # not converted: the API's rule refuses it
    (dict(bmm1_scale=True), "bmm1_scale must be a real Python number"),
    (dict(block_tables=torch.zeros(3, 1, 32, dtype=torch.int32)), "expected [3, 1, 64]"),
    (dict(sinks=[torch.zeros(16), torch.zeros(16)]), "got a list of 2"),
    (dict(lse=torch.empty(3, 16)), "lse was given without return_lse=True"),
    (dict(return_lse=True, lse=torch.empty(16, 3)), "lse must be float32 [3, 16] or [3, 1, 16]"),
    (dict(return_lse_base="base10"), "return_lse_base must be 'basee', 'base2' or None"),
    (dict(return_lse_base="basee", lse_convention="log2_with_sink"), "pass one"),
    (dict(lse_convention="log10"), "lse_convention must be one of"),
    (dict(seq_lens=torch.zeros(2, dtype=torch.int32)), "seq_lens has shape [2], expected [3], [3] or [3, 1]"),
    (dict(seq_lens=torch.zeros(3, dtype=torch.int32), sparse_mla_top_k_lens=torch.zeros(3, dtype=torch.int32)),
     "seq_lens or sparse_mla_top_k_lens, not both"),
    (dict(query=torch.randn(3, 16, 576).to(torch.bfloat16)), "query must be [batch, seq_q, num_heads, 576]"),
    (dict(query=torch.randn(3, 1, 16, 512).to(torch.bfloat16)), "query has QK width 512, expected d_qk = 576"),
    (dict(kv_cache=torch.zeros(4, 1, 64, 584, dtype=torch.uint8)), "expected [num_blocks, P, 1, 656]"),
])
def test_flashinfer_mla_adapter_refuses_what_it_does_not_serve(overrides, message):
    text = _refused(trtllm_batch_decode_with_kv_cache_mla, **_vllm_v32_call(**overrides))
    assert message in text
    prefix = GENERIC_MODEL_TYPE if "qk_rope_head_dim" in overrides else V32_FP8.model_type
    assert text.startswith(prefix + ": ")


def test_flash_mla_adapter_serves_v32_and_refuses_a_wrong_value_width():
    q = torch.randn(2, 1, 16, 576).to(torch.bfloat16)
    idx = torch.zeros(2, 1, 32, dtype=torch.int32)
    text = _refused(flash_mla_with_kvcache, q, V32_CACHE, head_dim_v=512, is_fp8_kvcache=True, indices=idx)
    assert text.startswith(V32_FP8.model_type) and text.endswith("the kernels run on CUDA devices only")
    text = _refused(flash_mla_with_kvcache, q, V32_CACHE, head_dim_v=576, is_fp8_kvcache=True, indices=idx)
    assert text.startswith(V32_FP8.model_type) and "head_dim_v must be 512 (the value width of v32_fp8 caches)" in text
    text = _refused(flash_mla_with_kvcache, q[..., :512], GLM_CACHE, is_fp8_kvcache=True, indices=idx,
                    kv_format="glm_nope_fp8")
    assert text.startswith(GLM_NOPE_FP8.model_type) and text.endswith("the kernels run on CUDA devices only")


def test_dsv4_adapter_reads_model1_caches_only():
    q = torch.randn(2, 16, 512).to(torch.bfloat16)
    text = _refused(trtllm_batch_decode_sparse_mla_dsv4, q, V32_CACHE, None, torch.zeros(2, 32, dtype=torch.int32),
                    kv_layout="NHD")
    assert text.startswith(MODEL1_FP8.model_type) and "expected [num_blocks, P, 1, 584]" in text


def _vllm_dsv4_call(**overrides):
    """The call vLLM's DeepSeek-V4 SM12x attention makes (CPU tensors: refused at the device
    check when everything else is right)."""
    T, H = 3, 8
    cache = make_cache(4, 64, device="cpu", gen=torch.Generator().manual_seed(5))
    kw = dict(query=torch.randn(T, H, 512).to(torch.bfloat16), swa_kv_cache=cache,
              workspace_buffer=torch.empty(16, dtype=torch.uint8), sparse_indices=torch.zeros(T, 128,
                                                                                              dtype=torch.int32),
              compressed_kv_cache=cache, out=torch.empty(T, H, 512, dtype=torch.bfloat16), bmm1_scale=0.05,
              sinks=torch.zeros(H), kv_layout="NHD", swa_topk_lens=torch.full((T,), 7, dtype=torch.int32),
              extra_sparse_indices=torch.zeros(T, 1, 8192, dtype=torch.int32),
              extra_sparse_topk_lens=torch.full((T,), 9, dtype=torch.int32))
    kw.update(overrides)
    return kw


@pytest.mark.parametrize("overrides,message", [
    ({}, "the kernels run on CUDA devices only"),
    (dict(num_valid_heads=5), "the kernels run on CUDA devices only"),
    (dict(kv_layout="HND"), "swa_kv_cache of shape [4, 64, 1, 584] is not laid out as kv_layout='HND'"),
    (dict(bmm1_scale=torch.tensor(0.05)), "bmm1_scale must be a real Python number, not a tensor: it would be "
                                          "read back to the host"),
    (dict(bmm1_scale=1), "the kernels run on CUDA devices only"),
    (dict(bmm1_scale=True), "bmm1_scale must be a real Python number"),  # the API's rule, as for the MLA adapter
    (dict(swa_topk_lens=torch.full((3, 1), 7, dtype=torch.int32)), "the kernels run on CUDA devices only"),
    (dict(kv_layout="NDH"), "kv_layout must be 'HND' or 'NHD'"),
    (dict(backend="trtllm-gen"), "backend must be one of ('auto', 'sparse', 'cake')"),
    (dict(backend="cake"), "the kernels run on CUDA devices only"),
    # flashinfer-python 0.7.4's keywords: the cache formats mapped, the rest honoured or refused by name
    (dict(kv_cache_format="fp8"), "the kernels run on CUDA devices only"),
    (dict(kv_cache_format="fp4"), "kv_cache_format must be one of ['fp8', 'fp8_dsv41', 'fp8_dsv41_fp4_ca', "
                                  "'fp8_dsv41_inline', 'fp8_dsv41_inline_fp4_ca', 'nvfp4'], got 'fp4'"),
    (dict(kv_cache_format="nvfp4"), "expected [num_blocks, P, 1, 384]"),  # FP8 caches named NVFP4
    (dict(kv_cache_format="nvfp4", swa_kv_cache=NVFP4_CACHE, compressed_kv_cache=NVFP4_CACHE),
     "the kernels run on CUDA devices only"),
    (dict(kv_cache_format="fp8_dsv41_fp4_ca", swa_kv_cache=V41_CACHE, compressed_kv_cache=V41_NVFP4_CACHE),
     "the kernels run on CUDA devices only"),
    (dict(kv_cache_format="fp8_dsv41", swa_kv_cache=V41_CACHE, compressed_kv_cache=V41_NVFP4_CACHE),
     "[2, 64, 1, 288]: expected [num_blocks, P, 1, 528]"),  # the compressed cache named FP8
    (dict(sparse_topk_lens_offset=2), "sparse_topk_lens_offset must be the int 0"),
    (dict(sparse_topk_lens_offset=torch.zeros(1, dtype=torch.int32)), "sparse_topk_lens_offset must be the int 0"),
    (dict(dsv4_output_scale=torch.ones(1)), "dsv4_output_scale: not served"),
    (dict(lse_scale=1.0, split_scratch=torch.empty(4)),
     "lse_scale, split_scratch: not a keyword of FlashInfer's trtllm_batch_decode_sparse_mla_dsv4 this call shape "
     "serves (checked against flashinfer-python 0.7.2 and 0.7.4)"),
    (dict(hca_seq_lens=torch.zeros(3, dtype=torch.int32)), "hca_seq_lens: not served (FlashInfer's HCA inputs"),
    (dict(sparse_indices_are_storage_offsets=True), "sparse_indices_are_storage_offsets: not served"),
    (dict(cum_seq_lens_q=torch.zeros(4, dtype=torch.int32)), "cum_seq_lens_q (ragged query lengths) is not served"),
    (dict(sparse_indices=None), "sparse_indices is required"),
    (dict(sparse_topk_lens=torch.zeros(3, dtype=torch.int32)),
     "sparse_topk_lens is FlashInfer's SM100 length of one combined table"),
    (dict(sparse_topk_lens=torch.zeros(3, dtype=torch.int32), swa_topk_lens=None),
     "pass the main list's lengths as swa_topk_lens"),
    (dict(compressed_kv_cache=None), "compressed_kv_cache and extra_sparse_indices go together"),
    (dict(compressed_kv_cache=None, extra_sparse_indices=None, extra_sparse_topk_lens=None),
     "the kernels run on CUDA devices only"),  # no compressed cache
    # FlashInfer's "fp8" call: the compressed cache is the FP8 record too, never read as NVFP4
    (dict(compressed_kv_cache=make_cache(4, 64, device="cpu", kv_format="model1_nvfp4")),
     "[4, 64, 1, 384]: expected [num_blocks, P, 1, 584]"),
    (dict(bmm2_scale=0.5), "bmm2_scale must be 1.0"),
    (dict(num_valid_heads=9), "num_valid_heads must be an int in [1, num_heads], got 9"),
    (dict(num_valid_heads=4, out=None), "num_valid_heads needs out"),
])
def test_dsv4_adapter_serves_vllms_call_and_refuses_the_rest(overrides, message):
    text = _refused(trtllm_batch_decode_sparse_mla_dsv4, **_vllm_dsv4_call(**overrides))
    main = DSV4_KV_CACHE_FORMATS.get(overrides.get("kv_cache_format", "fp8"), ("model1_fp8",))[0]
    assert text.startswith(FORMATS[main].model_type) and message in text


def test_sglang_adapter_takes_sglangs_keywords():
    q = torch.randn(2, 1, 64, 512).to(torch.bfloat16)
    cache = make_cache(2, 256, device="cpu", gen=torch.Generator().manual_seed(6))
    idx = torch.zeros(2, 1, 128, dtype=torch.int32)
    text = _refused(flash_mla_with_kvcache_sm120, q=q, k_cache=cache, head_dim_v=512, indices=idx,
                    softmax_scale=None, topk_length=torch.full((2,), 3, dtype=torch.int32), attn_sink=torch.zeros(64),
                    extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
    assert text.startswith(MODEL1_FP8.model_type + ": num_tokens=2, num_heads=64, topk=128, d_qk=512, "
                                                   "page_block_size=256")
    assert text.endswith("the kernels run on CUDA devices only")
    with pytest.raises(TypeError):  # keywords only, as SGLang calls it
        flash_mla_with_kvcache_sm120(q, cache, idx, 512)
    text = _refused(trtllm_batch_decode_sparse_mla_dsv4, **dict(_vllm_dsv4_call(), sparse_indice=idx,
                                                                 sparse_indices=None))
    assert "sparse_indice: not a keyword" in text  # not "sparse_indices is required"
    assert "head_dim_v must be 512" in _refused(flash_mla_with_kvcache_sm120, q=q, k_cache=cache, indices=idx,
                                                 head_dim_v=576)
    # SGLang's function takes **kwargs: a keyword a later SGLang passes is refused by name
    text = _refused(flash_mla_with_kvcache_sm120, q=q, k_cache=cache, head_dim_v=512, indices=idx, causal=False,
                    is_fp8_kvcache=True)
    assert text.endswith("causal, is_fp8_kvcache: not a keyword of SGLang's flash_mla_with_kvcache_sm120 this "
                         "call shape serves (checked against SGLang 0.5.23)")
    # a misspelt keyword is named as unknown, not as the required one missing
    text = _refused(flash_mla_with_kvcache_sm120, q=q, k_cache=cache, head_dim_v=512, indice=idx)
    assert "indice: not a keyword" in text
    assert "indices required" in _refused(flash_mla_with_kvcache_sm120, q=q, k_cache=cache, head_dim_v=512)


@pytest.mark.parametrize("adapter", ["flash_mla", "trtllm", "trtllm_no_lse"])
def test_adapters_refuse_an_unknown_lse_convention_first(adapter):
    """Before any device work (the CPU inputs would be refused next) and whether or not an lse
    is returned."""
    base = _inputs()
    with pytest.raises(InvalidDecodeInput, match="lse_convention must be one of") as info:
        if adapter == "flash_mla":
            flash_mla_with_kvcache(base["q"][None], base["kv_cache"], indices=base["indices"][None],
                                            is_fp8_kvcache=True, lse_convention="log10")
        else:
            trtllm_batch_decode_sparse_mla_dsv4(base["q"], base["kv_cache"], None, base["indices"],
                                                         return_lse=adapter == "trtllm", lse_convention="log10")
    assert info.value.metadata.num_heads == 16


def test_dsv4_adapter_hands_each_tensor_to_its_own_field(monkeypatch):
    """The vLLM adapter builds its ``DecodeTensors`` by position (its hot path): each of
    vLLM's tensors lands in the field of its meaning."""
    seen = {}

    def capture(given, **options):
        seen.update(given._asdict(), options=options)
        raise InvalidDecodeInput(DecodeMetadata(), "captured")

    monkeypatch.setattr(flashinfer_dsv4, "one_shot_decode", capture)
    kw = _vllm_dsv4_call()
    _refused(trtllm_batch_decode_sparse_mla_dsv4, **kw)
    expected = dict(q=kw["query"], kv_cache=kw["swa_kv_cache"], indices=kw["sparse_indices"],
                    topk_length=kw["swa_topk_lens"], attn_sink=kw["sinks"], out=kw["out"], lse=None,
                    extra_kv_cache=kw["compressed_kv_cache"], extra_indices=kw["extra_sparse_indices"],
                    extra_topk_length=kw["extra_sparse_topk_lens"])
    assert all(seen[name] is t for name, t in expected.items()), [n for n, t in expected.items() if seen[n] is not t]
    assert seen["options"]["sm_scale"] == kw["bmm1_scale"]


# ---------------------------------------------------------------------- FlashInfer's signatures, by release
REQUIRED = object()  # a parameter the peer declares without a default (here it may default to None)
# trtllm_batch_decode_sparse_mla_dsv4's parameters in flashinfer-python 0.7.2 and 0.7.4
# (flashinfer/mla/_core.py; the same 31 positional parameters in both), with their defaults
FLASHINFER_DSV4_POSITIONAL = (
    ("query", REQUIRED), ("swa_kv_cache", REQUIRED), ("workspace_buffer", REQUIRED), ("sparse_indices", None),
    ("compressed_kv_cache", None), ("sparse_topk_lens", None), ("seq_lens", None), ("out", None),
    ("bmm1_scale", 1.0), ("bmm2_scale", 1.0), ("sinks", None), ("kv_layout", "HND"), ("cum_seq_lens_q", None),
    ("max_q_len", None), ("enable_pdl", None), ("swa_topk_lens", None), ("extra_sparse_indices", None),
    ("extra_sparse_topk_lens", None), ("backend", "auto"), ("hca_swa_indices", None),
    ("hca_compressed_block_tables", None), ("hca_seq_lens", None), ("hca_is_causal", True),
    ("hca_use_persistent", False), ("hca_sparse_indices_format", None), ("remapped_sparse_indices_buffer", None),
    ("sparse_indices_are_storage_offsets", None), ("dsv4_inv_rope_cos_sin_cache", None),
    ("dsv4_output_scale", None), ("sparse_topk_lens_offset", 0), ("multi_ctas_kv_counter_buffer", None),
)
FLASHINFER_DSV4_KEYWORD_ONLY = (("kv_cache_format", "fp8"),)
# trtllm_batch_decode_with_kv_cache_mla's 33 parameters (0.7.2 and 0.7.4: the same, none keyword-only)
FLASHINFER_MLA_POSITIONAL = (
    ("query", REQUIRED), ("kv_cache", REQUIRED), ("workspace_buffer", REQUIRED), ("qk_nope_head_dim", REQUIRED),
    ("kv_lora_rank", REQUIRED), ("qk_rope_head_dim", REQUIRED), ("block_tables", REQUIRED), ("seq_lens", REQUIRED),
    ("max_seq_len", REQUIRED), ("sparse_mla_top_k", 0), ("out", None), ("bmm1_scale", 1.0), ("bmm2_scale", 1.0),
    ("sinks", None), ("skip_softmax_threshold_scale_factor", None), ("enable_pdl", None), ("backend", "auto"),
    ("is_var_seq", True), ("uses_shared_paged_kv_idx", True), ("lse", None), ("return_lse", False),
    ("cute_dsl_impl", "auto"), ("kv_scale_format", "auto"), ("cum_seq_lens_q", None), ("max_q_len", None),
    ("multi_ctas_kv_counter_buffer", None), ("sparse_mla_top_k_lens", None), ("enable_dcp", False),
    ("cp_world", 1), ("cp_rank", 0), ("causal_seqlens_kv_global", None), ("use_fp16_softmax", None),
    ("return_lse_base", None),
)
# FlashMLA's flash_mla_with_kvcache (vLLM 0.34's vendored flash_mla_interface.py; FlashMLA 9241ae3)
FLASHMLA_POSITIONAL = (
    ("q", REQUIRED), ("k_cache", REQUIRED), ("block_table", REQUIRED), ("cache_seqlens", REQUIRED), ("head_dim_v", REQUIRED),
    ("tile_scheduler_metadata", REQUIRED), ("num_splits", None), ("softmax_scale", None), ("causal", False),
    ("is_fp8_kvcache", False), ("indices", None), ("attn_sink", None), ("extra_k_cache", None),
    ("extra_indices_in_kvcache", None), ("topk_length", None), ("extra_topk_length", None), ("out", None),
    ("enable_batch_invariant", False),
)


def _parameters(fn, kind):
    import inspect

    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.kind == kind]


@pytest.mark.parametrize("fn,positional,keyword_only", [
    (trtllm_batch_decode_sparse_mla_dsv4, FLASHINFER_DSV4_POSITIONAL, FLASHINFER_DSV4_KEYWORD_ONLY),
    (trtllm_batch_decode_with_kv_cache_mla, FLASHINFER_MLA_POSITIONAL, ()),
    (flash_mla_with_kvcache, FLASHMLA_POSITIONAL, ()),
])
def test_call_shapes_take_the_peers_parameters_in_their_order(fn, positional, keyword_only):
    """A caller passing by position lands each argument in the parameter of its meaning; the
    defaults are the peer's, where the peer has one (a required parameter may default to None here)."""
    import inspect

    ours = _parameters(fn, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert [n for n, _ in ours] == [n for n, _ in positional]
    for (name, default), (_, theirs) in zip(ours, positional):
        assert theirs is REQUIRED or (default is None if theirs is None else default == theirs), (name, default, theirs)
    ours_kw = dict(_parameters(fn, inspect.Parameter.KEYWORD_ONLY))
    assert all(ours_kw[name] == default for name, default in keyword_only)


def test_dsv4_call_accepts_flashinfers_scratch_buffers_and_default_none():
    scratch = dict(remapped_sparse_indices_buffer=torch.empty(64, dtype=torch.int32),
                   multi_ctas_kv_counter_buffer=torch.zeros(8, dtype=torch.int32),
                   sparse_indices_are_storage_offsets=None)
    assert _refused(trtllm_batch_decode_sparse_mla_dsv4, **_vllm_dsv4_call(**scratch)).endswith(
        "the kernels run on CUDA devices only")
    kw = _vllm_dsv4_call()
    # all 31 by position, as a positional caller passes them: each lands in its own parameter
    args = [kw.get(name, default) for name, default in FLASHINFER_DSV4_POSITIONAL]
    args[28] = torch.ones(1)  # dsv4_output_scale
    assert "dsv4_output_scale: not served" in _refused(trtllm_batch_decode_sparse_mla_dsv4, *args)
    args[28], args[29] = None, 3  # sparse_topk_lens_offset
    assert "sparse_topk_lens_offset must be the int 0 (it offsets sparse_topk_lens" in _refused(
        trtllm_batch_decode_sparse_mla_dsv4, *args)
    args[29], args[27] = 0, torch.ones(1)  # dsv4_inv_rope_cos_sin_cache
    assert "dsv4_inv_rope_cos_sin_cache: not served" in _refused(trtllm_batch_decode_sparse_mla_dsv4, *args)


def _flashmla_v4_call(**overrides):
    """vLLM's Hopper DeepSeek-V4 call (``_forward_decode``: keywords, q padded to 64 heads)."""
    T = 3
    cache = make_cache(4, 64, device="cpu", gen=torch.Generator().manual_seed(7))
    kw = dict(q=torch.randn(T, 1, 64, 512).to(torch.bfloat16), k_cache=cache, block_table=None, head_dim_v=512,
              tile_scheduler_metadata=object(), cache_seqlens=None, is_fp8_kvcache=True,
              indices=torch.zeros(T, 1, 128, dtype=torch.int32), topk_length=torch.full((T,), 5, dtype=torch.int32),
              softmax_scale=512 ** -0.5, attn_sink=torch.zeros(64), extra_k_cache=cache,
              extra_indices_in_kvcache=torch.zeros(T, 1, 512, dtype=torch.int32),
              extra_topk_length=torch.full((T,), 9, dtype=torch.int32),
              out=torch.empty(T, 1, 64, 512, dtype=torch.bfloat16))
    kw.update(overrides)
    return kw


@pytest.mark.parametrize("overrides,message", [
    ({}, "the kernels run on CUDA devices only"),
    (dict(num_valid_heads=16), "the kernels run on CUDA devices only"),
    (dict(num_valid_heads=16, out=None), "the kernels run on CUDA devices only"),
    # vLLM's V3.2 call passes placeholders FlashMLA's sparse path does not read
    (dict(block_table=torch.empty(4, 1, dtype=torch.int32), cache_seqlens=torch.zeros(3, dtype=torch.int32)),
     "the kernels run on CUDA devices only"),
    (dict(enable_batch_invariant=True), "enable_batch_invariant=True is not served"),
    (dict(causal=True), "causal must be False"),
    (dict(is_fp8_kvcache="yes"), "only the sparse FP8 decode path is served"),
    (dict(num_valid_heads=65), "num_valid_heads must be an int in [1, num_heads], got 65"),
    (dict(num_valid_heads=True), "num_valid_heads must be an int in [1, num_heads], got True"),
    (dict(return_lse=1), "return_lse must be True or False, got 1"),
    (dict(head_dim_v="512"), "head_dim_v must be 512 (the value width of model1_fp8 caches), got '512'"),
    (dict(out=torch.empty(3, 1, 64, 512, dtype=torch.bfloat16)[:, :, :, :256]), "out has shape"),
])
def test_flashmla_call_serves_the_engines_hopper_call_and_refuses_the_rest(overrides, message):
    assert message in _refused(flash_mla_with_kvcache, **_flashmla_v4_call(**overrides))


def test_flashinfer_mla_lse_is_an_output_of_the_call_checked_as_one():
    """The lse FlashInfer's MLA call writes is written by the call (not copied after it): an lse
    over the output's memory is refused before any GPU work, as any overlapping output is."""
    kw = _vllm_v32_call()
    buf = torch.empty(3 * 16 * 512 * 2, dtype=torch.uint8)
    kw["out"] = buf.view(torch.bfloat16).view(3, 1, 16, 512)
    kw["lse"] = buf[: 3 * 16 * 4].view(torch.float32).view(3, 16)
    assert "overlaps" in _refused(trtllm_batch_decode_with_kv_cache_mla, return_lse=True, **kw)
    kw["lse"] = torch.empty(1).expand(3, 16)
    assert "lse has a stride of 0" in _refused(trtllm_batch_decode_with_kv_cache_mla, return_lse=True, **kw)


@pytest.mark.parametrize("flag,value", [("return_lse", "no"), ("uses_shared_paged_kv_idx", "False"),
                                        ("enable_pdl", 1), ("is_var_seq", None)])
def test_flashinfer_mla_flags_take_booleans_only(flag, value):
    assert f"{flag} must be" in _refused(trtllm_batch_decode_with_kv_cache_mla, **_vllm_v32_call(**{flag: value}))


def test_sglang_glm_call_reaches_the_mla_call_shape():
    """SGLang's DSA decode of GLM-5 on SM120 (``flashinfer_sparse_mla_forward``): q [T, H, 576],
    the pool's rows, indices [T, topk], seq_lens [T]: this library's refusal of CPU tensors."""
    from dispatch.engines.flashinfer_mla import flashinfer_sparse_mla_forward

    T, H, topk = 3, 8, 64
    kw = dict(q=torch.randn(T, H, 576).to(torch.bfloat16), kv_cache=V32_CACHE, indices=torch.zeros(T, topk,
                                                                                                  dtype=torch.int32),
              seq_lens=torch.full((T,), 5, dtype=torch.int32), workspace_buffer=None, page_size=V32_CACHE.shape[1],
              kv_cache_dim=656, qk_nope_head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64, sm_scale=0.05,
              skip_softmax_threshold_scale_factor=None)
    text = _refused(flashinfer_sparse_mla_forward, **kw)
    assert text.startswith(V32_FP8.model_type + ": num_tokens=3, num_heads=8, topk=64") and "CUDA devices only" in text
    assert "skip_softmax_threshold_scale_factor is not served" in _refused(
        flashinfer_sparse_mla_forward, **dict(kw, skip_softmax_threshold_scale_factor=0.5))
