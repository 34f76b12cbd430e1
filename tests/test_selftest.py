"""``dsv4-mla-selftest``: its arguments, the deployment shapes it picks, the peer calls it
builds (against a stand-in FlashInfer module of the real function's signature), its reports,
and its refusal without a GPU (CPU); one quick run on a GPU (marker gpu)."""

from __future__ import annotations

import inspect
import json
import math
import sys
import types

import pytest
import torch

from dispatch import selftest
from dispatch.registry import DEPLOYMENT_SHAPES, MODELS
from dispatch.selftest import EXIT_NO_GPU, Row, flashinfer_call, flashmla_call, parse_args, shapes_for


def test_models_map_to_the_registry_heads():
    for name, model in MODELS.items():
        heads = {s.num_heads for s in DEPLOYMENT_SHAPES if s.model == model.name}
        assert heads == set(model.heads_per_gpu()), name
    args = parse_args(["--model", "deepseek-v4-flash", "--tp", "4"])
    assert args.models == ["deepseek-v4-flash"] and args.token_counts == selftest.TOKENS
    assert parse_args(["--quick"]).token_counts == selftest.QUICK_TOKENS
    assert parse_args(["--tokens", "2,300"]).token_counts == (2, 300)


@pytest.mark.parametrize("argv,message", [
    (["--model", "glm-5.3", "--tp", "8"], "--tp 8: glm-5.3 (64 query heads) is deployed at tp [1, 2, 4]"),
    (["--model", "deepseek-v5"], "invalid choice: 'deepseek-v5'"),
    (["--tokens", "1,x"], "--tokens '1,x': expected comma-separated positive ints"),
    (["--tokens", "0"], "--tokens '0': expected comma-separated positive ints"),
    (["--model", "deepseek-v3.2", "--format", "model1_nvfp4"], "--format model1_nvfp4: none of the shapes"),
])
def test_arguments_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_shapes_are_the_deployments_one_per_kernel_choice():
    shapes = shapes_for(["deepseek-v4-flash"], 4)
    assert shapes and all(s.model == "V4-Flash" and s.num_heads == 16 for s in shapes)
    pairs = {(s.kv_format, s.extra_kv_format) for s in shapes}
    assert pairs == {("model1_fp8", None), ("model1_nvfp4", None), ("model1_fp8", "model1_nvfp4"),
                     ("model1_nvfp4", "model1_fp8")}
    keys = [(s.kv_format, s.extra_kv_format, s.topk, s.extra_topk) for s in shapes]
    assert len(keys) == len(set(keys))  # no page-size duplicates
    quick = shapes_for(["deepseek-v4-flash"], 4, quick=True)
    assert len(quick) < len(shapes) and {(s.kv_format, s.extra_kv_format) for s in quick} == pairs
    assert all("model1_nvfp4" in (s.kv_format, s.extra_kv_format)
               for s in shapes_for(["deepseek-v4-flash"], 4, "model1_nvfp4"))


def _inputs(H=16, T=3, extra=True, kv_format="model1_fp8", extra_format=None):
    q = torch.randn(T, H, 512).to(torch.bfloat16)
    cache = torch.zeros(4, 64, 1, 584, dtype=torch.uint8)
    idx = torch.zeros(T, 128, dtype=torch.int32)
    kw = {"kv_format": kv_format, "topk_length": torch.full((T,), 5, dtype=torch.int32), "attn_sink": torch.zeros(H)}
    if extra:
        kw.update(extra_kv_cache=cache, extra_indices=torch.zeros(T, 512, dtype=torch.int32),
                  extra_kv_format=extra_format or kv_format)
    return q, cache, idx, kw


def _fake_flashinfer(monkeypatch, calls: list):
    """A stand-in ``flashinfer`` package whose ``decode.trtllm_batch_decode_sparse_mla_dsv4``
    has the real function's keywords (flashinfer-python 0.7.4) and records its calls."""
    def trtllm_batch_decode_sparse_mla_dsv4(query, swa_kv_cache, workspace_buffer, sparse_indices=None,
                                            compressed_kv_cache=None, sparse_topk_lens=None, seq_lens=None, out=None,
                                            bmm1_scale=1.0, bmm2_scale=1.0, sinks=None, kv_layout="HND",
                                            cum_seq_lens_q=None, max_q_len=None, enable_pdl=None, swa_topk_lens=None,
                                            extra_sparse_indices=None, extra_sparse_topk_lens=None,
                                            sparse_topk_lens_offset=0, *, kv_cache_format="fp8", backend="auto"):
        calls.append(dict(locals()))
        return out

    package, decode = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.decode")
    decode.trtllm_batch_decode_sparse_mla_dsv4 = trtllm_batch_decode_sparse_mla_dsv4
    package.decode = decode
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    return trtllm_batch_decode_sparse_mla_dsv4


def test_flashinfer_call_is_the_one_vllm_makes(monkeypatch):
    calls = []
    fn = _fake_flashinfer(monkeypatch, calls)
    q, cache, idx, kw = _inputs()
    out = torch.empty(3, 16, 512, dtype=torch.bfloat16)
    call = flashinfer_call(q, cache, idx, kw, out, 0.0442)
    inspect.signature(fn).bind(**call)  # every keyword is the real function's
    fn(**call)
    got = calls[0]
    assert got["query"] is q and got["swa_kv_cache"] is cache and got["sparse_indices"] is idx and got["out"] is out
    assert got["swa_topk_lens"] is kw["topk_length"] and got["sinks"] is kw["attn_sink"]
    assert got["compressed_kv_cache"] is cache and got["extra_sparse_indices"] is kw["extra_indices"]
    assert torch.equal(got["extra_sparse_topk_lens"], torch.full((3,), 512, dtype=torch.int32))  # none given: all
    assert got["kv_layout"] == "NHD" and got["kv_cache_format"] == "fp8" and got["bmm1_scale"] == 0.0442
    assert got["sparse_topk_lens"] is None  # FlashInfer's SM100 argument, not SM120's
    q2, cache2, idx2, kw2 = _inputs(kv_format="v41_fp8", extra_format="v41_nvfp4")
    assert flashinfer_call(q2, cache2, idx2, kw2, out, 0.05)["kv_cache_format"] == "fp8_dsv41_fp4_ca"


@pytest.mark.parametrize("kw_change,heads,reason", [
    (dict(kv_format="v32_fp8", extra=False), 16, "FlashInfer's DeepSeek-V4 call reads no v32_fp8+v32_fp8 caches"),
    (dict(kv_format="model1_fp8", extra_format="model1_nvfp4"), 16, "reads no model1_fp8+model1_nvfp4 caches"),
    ({}, 24, "FlashInfer takes (8, 16, 32, 64, 128) heads, not 24"),
])
def test_flashinfer_call_says_why_not(kw_change, heads, reason):
    q, cache, idx, kw = _inputs(H=heads, **kw_change)
    got = flashinfer_call(q, cache, idx, kw, None, 0.05)
    assert isinstance(got, str) and got.startswith("not available:") and reason in got


def test_flashmla_call_takes_its_shapes_and_says_why_not():
    q, cache, idx, kw = _inputs(H=64)
    call = flashmla_call(q, cache, idx, kw, 0.05)
    assert call["q"].shape == (3, 1, 64, 512) and call["indices"].shape == (3, 1, 128) and call["is_fp8_kvcache"]
    assert call["extra_indices_in_kvcache"].shape == (3, 1, 512)
    assert "FlashMLA takes (64, 128) heads, not 16" in flashmla_call(*_inputs(H=16), 0.05)
    assert "MODEL1 FP8 caches only" in flashmla_call(*_inputs(H=64, kv_format="model1_nvfp4"), 0.05)


def test_peers_report_why_they_cannot_run(monkeypatch):
    _fake_flashinfer(monkeypatch, [])
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # "not installed": its import fails
    peers = selftest.peer_functions("sm_90a")
    fn, why = peers["FlashInfer"]
    assert fn is None and "run on sm_120 / sm_121, not sm_90a" in why
    assert peers["FlashMLA"][0] is None and "flash_mla does not import" in peers["FlashMLA"][1]
    fn, why = selftest.peer_functions("sm_120a")["FlashInfer"]
    assert fn is sys.modules["flashinfer.decode"].trtllm_batch_decode_sparse_mla_dsv4 and why is None


def test_reports_say_what_ran(tmp_path):
    env = {"gpu": "Test GPU", "arch": "sm_120a", "sms": 188, "torch": "2.13", "cuda": "13.0", "dsl": "x",
           "python": "3.12", "deployment": "deepseek-v4-flash at tp 4",
           "kernels": {"aot /opt/aot": ["k1", "k2"], "compiled": ["k3"]}}
    rows = [Row("V4-Flash", 16, "model1_fp8", None, 128, 0, 64, None, 8, "f16", 0.62, True, 10.5,
                {"FlashInfer": 12.0, "FlashMLA": "not available: FlashMLA takes (64, 128) heads, not 16"}),
            Row("V4-Flash", 16, "model1_fp8", None, 128, 0, 64, None, 8, "bf16", 2.5, False, 11.0, {})]
    written = selftest.write_reports(env, rows, tmp_path)
    data = json.loads((tmp_path / "dsv4-mla-selftest.json").read_text())
    assert [r["precision"] for r in data["rows"]] == ["f16", "bf16"] and data["rows"][1]["passed"] is False
    line = data["summary"]
    assert "accuracy FAIL on 1 of 2" in line and "worst out error 2.50 x its bound" in line
    assert "3 used, 1 compiled in this process" in line and "FlashInfer timed on 1 rows" in line
    md = (tmp_path / "dsv4-mla-selftest.md").read_text()
    assert "| model1_fp8 T=8 H=16 topk=128 | f16 | 0.62 | pass | 10.5 | 12.0 | n/a |" in md
    assert "FlashMLA: not available: FlashMLA takes (64, 128) heads, not 16" in md
    assert "- compiled: 1" in md
    assert (tmp_path / "dsv4-mla-selftest.png" in written) == (tmp_path / "dsv4-mla-selftest.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the command would run")
def test_without_a_gpu_it_says_so_in_one_line(capsys):
    assert selftest.main(["--model", "deepseek-v4-flash", "--quick"]) == EXIT_NO_GPU
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU is visible" in err[0]


@pytest.mark.gpu
def test_quick_run_on_the_gpu(tmp_path):
    status = selftest.main(["--model", "deepseek-v4-flash", "--tp", "4", "--quick", "--tokens", "1,9",
                            "--precision", "f16", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "dsv4-mla-selftest.json").read_text())
    assert status == 0 and data["rows"] and all(r["passed"] for r in data["rows"])
    assert all(r["us"] > 0 and math.isfinite(r["error_over_bound"]) for r in data["rows"])
    assert {r["kv_format"] for r in data["rows"]} == {"model1_fp8", "model1_nvfp4"}
    assert sum(len(v) for v in data["environment"]["kernels"].values()) > 0
