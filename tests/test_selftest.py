"""``dsv4-mla-selftest`` (CPU): the deployment a user names (--model / --tp / --format) mapped
onto the registry, the refusals of what names none, the line and exit status without a GPU,
the reports of a result, where each kernel will come from, and the peers' calls built against
stand-in ``flashinfer`` / ``flash_mla`` modules of the real functions' signatures (so that no
peer nor GPU is needed to check them); one quick run on a GPU (marker gpu)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import subprocess
import sys
import types

import pytest
import torch

from dispatch.policy.registry import DEPLOYMENT_SHAPES, MODELS
from dispatch.policy.variant_space import variant_space
from dispatch.runtime import loader
from dispatch.runtime.fingerprint import fingerprint, fingerprint_id
from dispatch.tools import selftest
from dispatch.tools.sample_inputs import make_cache
from dispatch.tools.selftest_peers import flashinfer_call, flashmla_call, peer_calls, time_peer
from dispatch.tools.selftest_report import markdown, summary_line, write_reports
from dispatch.tools.selftest_shapes import UsageError, resolve_model, select_deployment


# ---------------------------------------------------------------------- the deployment
@pytest.mark.parametrize("given,key", [
    ("deepseek-v4-flash", "deepseek-v4-flash"), ("DeepSeek-V4-Pro", "deepseek-v4-pro"),
    ("V4-FLASH", "deepseek-v4-flash"),
    ("deepseek-v4.1-flash", "deepseek-v4.1-flash"), ("DeepSeek-V3.2", "deepseek-v3.2"), ("GLM-5", "glm-5"),
    ("glm-5.x", "glm-5"), ("GLM-5.3", "glm-5.3"), (" v3.2 ", "deepseek-v3.2"),
])
def test_model_names_users_give(given, key):
    assert resolve_model(given) == key


def test_every_model_is_served_at_its_heads_over_tp():
    for key, model in MODELS.items():
        for tp in model.tps:
            deployment = select_deployment(key, tp)
            want = [s for s in DEPLOYMENT_SHAPES if s.model == model.name and s.num_heads == model.heads // tp]
            assert {st.shape for st in deployment.shapes} == set(want), (key, tp)
            assert all(st.models == (model.name,) and st.attn_sink == model.attn_sink for st in deployment.shapes)
    flash = select_deployment("DeepSeek-V4-Flash", 4)
    assert "TP 4 (16 query heads per GPU)" in flash.description and len(flash.shapes) == 28
    assert {(st.shape.kv_format, st.shape.extra_kv_format) for st in flash.shapes} == {
        ("model1_fp8", None), ("model1_nvfp4", None), ("model1_fp8", "model1_nvfp4"), ("model1_nvfp4", "model1_fp8")}
    every = select_deployment("deepseek-v4.1-flash")  # without --tp: every head count of the model
    assert {st.shape.num_heads for st in every.shapes} == {64, 32, 16, 8}


@pytest.mark.parametrize("model,tp,message", [
    ("deepseek-v4-flash", 3, "--tp 3: deepseek-v4-flash has 64 query heads, served at 64, 32, 16, 8, 4 per GPU: "
                             "--tp one of 1, 2, 4, 8, 16"),
    ("glm-5.3", 8, "--tp 8: glm-5.3 has 64 query heads, served at 64, 32, 16 per GPU: --tp one of 1, 2, 4"),
    ("deepseek-v4-pro", 0, "--tp one of 1, 2, 4, 8, 16"),
    ("deepseek-v5", None, "--model 'deepseek-v5': not a model of the registry; one of deepseek-v4-flash, "),
    (None, 4, "--tp needs --model"),
])
def test_a_deployment_the_registry_lacks_is_refused_naming_the_valid_ones(model, tp, message):
    with pytest.raises(UsageError) as info:
        select_deployment(model, tp)
    assert message in str(info.value)


def test_by_default_every_model_at_the_head_count_all_share_each_call_once():
    deployment = select_deployment()
    assert {st.shape.num_heads for st in deployment.shapes} == {64}
    assert {m for st in deployment.shapes for m in st.models} == {m.name for m in MODELS.values()}
    # V4-Flash and V4-Pro share their main-cache shapes at 64 heads: one call naming both
    shared = [st for st in deployment.shapes if st.models == ("V4-Flash", "V4-Pro")]
    assert shared and all(st.label.startswith("V4-Flash/V4-Pro 64h ") for st in shared)
    keys = [(st.shape.num_heads, st.shape.topk, st.shape.page_block_size, st.shape.extra_topk,
             st.shape.extra_page_block_size, st.shape.kv_format, st.shape.extra_kv_format) for st in deployment.shapes]
    assert len(keys) == len(set(keys))


def test_quick_keeps_every_list_shape_at_one_page_size_and_format_filters():
    full, quick = select_deployment("deepseek-v4-flash", 2), select_deployment("deepseek-v4-flash", 2, quick=True)
    lists = lambda d: {(s.shape.topk, s.shape.extra_topk, s.shape.kv_format, s.shape.extra_kv_format)  # noqa: E731
                       for s in d.shapes}
    assert len(quick.shapes) < len(full.shapes) and lists(quick) == lists(full)
    nvfp4 = select_deployment("deepseek-v4-flash", 2, "model1_nvfp4")
    assert nvfp4.shapes and all(st.shape.kv_format == "model1_nvfp4" for st in nvfp4.shapes)
    extra_only = select_deployment("deepseek-v4.1-flash", 1, "v41_nvfp4")  # read only as the compressed cache
    assert extra_only.shapes and all(st.shape.extra_kv_format == "v41_nvfp4" for st in extra_only.shapes)
    with pytest.raises(UsageError, match=r"--format model1_fp8: no deployment shape of glm-5.3 .*glm_nope_fp8"):
        select_deployment("glm-5.3", None, "model1_fp8")


@pytest.mark.parametrize("argv,message", [
    (["--model", "deepseek-v5"], "not a model of the registry"),
    (["--model", "glm-5.3", "--tp", "8"], "--tp one of 1, 2, 4"),
    (["--tp", "4"], "--tp needs --model"),
    (["--tokens", "1,x"], "comma-separated positive token counts"),
    (["--tokens", "0"], "comma-separated positive token counts"),
    (["--precision", "fp4"], "invalid choice: 'fp4'"),
    (["--format", "model2"], "invalid choice: 'model2'"),
])
def test_arguments_are_refused_with_exit_status_2_before_looking_for_a_gpu(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("looked for a GPU"))
    with pytest.raises(SystemExit) as info:
        selftest.main(argv)
    assert info.value.code == selftest.EXIT_USAGE and message in capsys.readouterr().err


def test_tokens_parse():
    args = selftest.build_parser().parse_args(["--tokens", "8,1,8", "--precision", "f16", "--precision", "fp8"])
    assert args.tokens == (8, 1) and args.precision == ["f16", "fp8"] and args.out == "." and args.seed == 0


def test_without_a_gpu_one_line_and_its_own_exit_status(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert selftest.main(["--model", "glm-5.3", "--quick"]) == selftest.EXIT_NO_GPU == 3
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv4-mla-selftest: no CUDA GPU is visible") and not captured.out


def test_help_explains_outputs_and_exit_statuses():
    done = subprocess.run([sys.executable, "-m", "dispatch.tools.selftest", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("usage: dsv4-mla-selftest")
    text = " ".join(done.stdout.split())
    for phrase in ("dsv4-mla-selftest.json", "dsv4-mla-selftest.md", "dsv4-mla-selftest.png", "Exit status: 0",
                   "1 an accuracy failure", "2 a usage error", "3 no CUDA GPU is visible", "--no-timing", "--seed"):
        assert phrase in text, phrase


# ---------------------------------------------------------------------- the calls
def test_cases_are_the_deployment_at_each_token_count_with_full_lists():
    deployment = select_deployment("deepseek-v4-flash", 8, quick=True)
    cases = selftest.make_cases(deployment, tokens=(1, 3), arch="sm_120a", wanted=None, seed=5, device="cpu")
    assert len(cases) == 2 * len(deployment.shapes)
    for case in cases:
        s = case.shape.shape
        assert case.q.shape == (case.num_tokens, 8, 512) and case.indices.shape == (case.num_tokens, s.topk)
        assert (case.kw["topk_length"] == s.topk).all() and case.kw["attn_sink"].shape == (8,)  # V4 has sinks
        formats = {s.kv_format, s.extra_kv_format or s.kv_format}
        if "model1_nvfp4" in formats:  # e2m1 values: the "f16" path alone
            assert case.paths == ["f16"]
        else:
            assert case.paths == ["f16", "bf16", "fp8", "mxf8"]  # the default first; mxf8 on sm_120
        if s.extra_topk:
            assert (case.kw["extra_topk_length"] == s.extra_topk).all()
            assert case.kw["extra_kv_format"] == (s.extra_kv_format or s.kv_format)
    glm = selftest.make_cases(select_deployment("glm-5.3", 1), tokens=(2,), arch="sm_90a", wanted=["fp8", "f16"],
                              seed=0, device="cpu")
    assert [c.paths for c in glm] == [["f16", "fp8"]] and "attn_sink" not in glm[0].kw  # GLM: no sinks, no mxf8
    again = selftest.make_cases(deployment, tokens=(1, 3), arch="sm_120a", wanted=None, seed=5, device="cpu")
    assert all(torch.equal(a.q, b.q) and torch.equal(a.indices, b.indices) for a, b in zip(cases, again))  # --seed


def test_the_variants_expected_are_those_the_plan_loads(monkeypatch):
    """What the self-test announces before running is what a plan of the call loads (its
    kernels stubbed: nothing is compiled or launched)."""
    from cute_kernels.arch import arch_facts
    from dispatch.api import validate_call
    from dispatch.runtime.plan import DecodePlan

    loaded = []
    monkeypatch.setattr(loader, "get_compiled", lambda variant: loaded.append(variant))
    monkeypatch.setattr(DecodePlan, "_make_kernels", lambda self, values: [])
    target = ("sm_120a", 188, arch_facts("sm_120a").smem_per_sm)
    deployment = select_deployment("deepseek-v4-flash", 4, "model1_fp8", quick=True)
    cases = selftest.make_cases(deployment, tokens=(1, 64), arch="sm_120a", wanted=None, seed=0, device="cpu")
    mixed = next(c for c in cases if c.shape.shape.extra_kv_format and c.num_tokens == 64)
    for case in [cases[0], cases[1], mixed]:
        for precision in case.paths:
            loaded.clear()
            DecodePlan(validate_call(case.q, case.cache, case.indices, precision=precision, for_plan=True,
                                     _target=target, **case.kw))
            assert loaded and tuple(loaded) == selftest.planned_variants(case, precision, _target=target)
    assert len(selftest.planned_variants(mixed, "f16", _target=target)) == 3  # a partial per format, the merge
    assert selftest.planned_variants(cases[0], "f16") == ()  # refused (CPU tensors): running it says why


def test_a_call_that_raises_is_reported_and_fails_the_run():
    cases = selftest.make_cases(select_deployment("glm-5.3", 4), tokens=(1,), arch="sm_90a", wanted=["f16"], seed=0,
                                device="cpu")
    rows = selftest.run_cases(cases, "sm_90a", timer=None, log=lambda *a, **k: None)
    entry = rows[0]["paths"]["f16"]
    assert entry["status"] == "error" and "the kernels run on CUDA devices only" in entry["error"]
    assert rows[0]["peers"] == {} and rows[0]["shape"] == "GLM-5.3 16h 2176@p64 glm_nope_fp8"


def test_a_whole_run_with_a_stand_in_gpu(tmp_path, monkeypatch, capsys):
    """``main`` end to end on the CPU: a stand-in sm_90a GPU, the decode replaced by the float64
    reference rounded to bf16 (within every bound), a stand-in timer; the announced kernels, the
    files, the table and the summary line, and exit status 0 (then 1 when a path is off)."""
    import dispatch
    from cute_kernels.arch import arch_facts
    from cute_kernels.sparse_mla_decode.reference import reference_decode
    from dispatch.tools import selftest_peers, timing

    target = ("sm_90a", 132, arch_facts("sm_90a").smem_per_sm)
    gpu = {"name": "Stand-in H200", "capability": [9, 0], "arch": "sm_90a", "sms": 132}
    monkeypatch.setattr(selftest, "find_gpu", lambda: (gpu, None, None))
    make_cases, planned = selftest.make_cases, selftest.planned_variants
    monkeypatch.setattr(selftest, "make_cases", lambda *a, **k: make_cases(*a, **k, device="cpu"))
    monkeypatch.setattr(selftest, "planned_variants", lambda case, p: planned(case, p, _target=target))
    scale = {"bf16": 1.0}

    def decode(q, cache, idx, precision=None, **kw):
        out, lse = reference_decode(q, cache, idx, **kw)
        return (out * scale.get(precision, 1.0)).to(torch.bfloat16), lse

    monkeypatch.setattr(dispatch, "sparse_mla_decode", decode)
    monkeypatch.setattr(selftest, "timing_unavailable", lambda: None)
    monkeypatch.setattr(timing, "plan_runner", lambda *a, **k: (lambda: None))
    monkeypatch.setattr(timing, "graph_time_us", lambda fn: (fn(), 5.0)[1])
    monkeypatch.setattr(selftest_peers, "WORKSPACE_BYTES", 16)
    for peer in ("flashinfer", "flash_mla"):
        monkeypatch.setitem(sys.modules, peer, None)
    monkeypatch.setenv("DSV4_MLA_CACHE_DIR", str(tmp_path / "jit"))
    monkeypatch.delenv("DSV4_MLA_AOT_DIR", raising=False)
    argv = ["--model", "GLM-5.3", "--tp", "4", "--tokens", "1,3", "--out", str(tmp_path / "out")]
    assert selftest.main(argv) == selftest.EXIT_OK
    captured = capsys.readouterr()
    data = json.loads((tmp_path / "out" / "dsv4-mla-selftest.json").read_text())
    assert data["exit_status"] == 0 and data["paths"] == ["f16", "bf16", "fp8"] and data["tokens"] == [1, 3]
    assert data["deployment"]["description"] == "glm-5.3 at TP 4 (16 query heads per GPU)"
    assert [r["num_tokens"] for r in data["rows"]] == [1, 3]
    for row in data["rows"]:
        assert all(e["status"] == "pass" and e["us"] == 5.0 and e["error_over_bound"] <= 0.5
                   for e in row["paths"].values())
        assert row["peers"]["FlashInfer"]["not_available"] == (  # an H200: the arch says it first
            "FlashInfer's SM120 sparse MLA kernels run on sm_120 / sm_121 only (this GPU: sm_90a)")
        assert row["peers"]["FlashMLA"]["not_available"].startswith("not installed")
    expected = data["kernels"]["expected"]
    assert expected and set(expected.values()) == {"compile"}  # no AOT build, empty JIT cache: announced
    assert f"need {len(expected)} kernel variants: {len(expected)} to compile (JIT)" in captured.err
    assert "compiled first (JIT), which takes a while; dsv4-mla-aot-build --arch sm_90a" in captured.err
    last = captured.out.strip().splitlines()[-1]
    assert last.startswith("dsv4-mla-selftest: Stand-in H200 (sm_90a, 132 SMs): 1 shape x 2 token counts x 3 paths "
                           "(f16, bf16, fp8): accuracy PASS (worst out error ")
    assert last.endswith(f"kernels: {len(expected)} variants, {len(expected)} not loaded")  # the decode was stubbed
    assert "| GLM-5.3 16h 2176@p64 glm_nope_fp8 | 1 |" in captured.out
    assert (tmp_path / "out" / "dsv4-mla-selftest.md").is_file()
    scale["bf16"] = 1.01  # a path 1% off: far above its bound
    assert selftest.main(argv + ["--no-timing"]) == selftest.EXIT_FAILED
    data = json.loads((tmp_path / "out" / "dsv4-mla-selftest.json").read_text())
    assert {r["paths"]["bf16"]["status"] for r in data["rows"]} == {"fail"} and data["rows"][0]["peers"] == {}
    assert "accuracy FAIL on 2 of 6 calls" in capsys.readouterr().out


# ---------------------------------------------------------------------- where kernels come from
def test_expected_source_reads_the_aot_manifest_and_the_jit_cache_without_loading(tmp_path, monkeypatch):
    variant = variant_space("sm_120a")[0]
    aot, jit = tmp_path / "aot", tmp_path / "jit"
    monkeypatch.delenv("DSV4_MLA_AOT_DIR", raising=False)
    monkeypatch.setenv("DSV4_MLA_CACHE_DIR", str(jit))
    monkeypatch.setattr(loader, "PACKAGE_AOT_DIR", tmp_path / "no_package_build")
    loader.set_aot_dir(aot)
    try:
        assert selftest.expected_source(variant) == "compile"
        entry = jit / fingerprint_id(fingerprint(variant))
        entry.mkdir(parents=True)
        (entry / "meta.json").write_text("{}")
        assert selftest.expected_source(variant) == f"jit disk cache {jit}"
        aot.mkdir()
        (aot / f"{variant.name}.o").write_bytes(b"object")
        stale = dict(fingerprint(variant), source_hash="other sources")
        manifest = {"format": loader.MANIFEST_FORMAT,
                    "entries": {variant.name: {"fingerprint": stale, "object": f"{variant.name}.o"}}}
        (aot / loader.MANIFEST).write_text(json.dumps(manifest))
        assert selftest.expected_source(variant).startswith("jit disk cache")  # a stale entry is passed over
        manifest["entries"][variant.name]["fingerprint"] = fingerprint(variant)
        (aot / loader.MANIFEST).write_text(json.dumps(manifest))
        assert selftest.expected_source(variant) == f"aot {aot}"
    finally:
        loader.set_aot_dir(None)


# ---------------------------------------------------------------------- reports
def _result(timing=True) -> dict:
    """A synthetic result: two calls of one shape, one failing in "bf16"."""
    def row(T, f16, bf16, peers):
        return {"shape": "V4-Flash 16h 128@p64 model1_fp8", "models": ["V4-Flash"], "num_heads": 16, "topk": 128,
                "page_block_size": 64, "extra_topk": 0, "extra_page_block_size": None, "kv_format": "model1_fp8",
                "extra_kv_format": None, "attn_sink": True, "num_tokens": T,
                "paths": {"f16": f16, "bf16": bf16}, "peers": peers}

    no_mla = {"us": None, "not_available": "FlashMLA's sparse decode runs on sm_90 / sm_100 only (this GPU: sm_120a)"}
    rows = [row(1, {"status": "pass", "error_over_bound": 0.62, "bad_tokens": [], "us": 10.5},
                {"status": "pass", "error_over_bound": 0.7, "bad_tokens": [], "us": 11.0},
                {"FlashInfer": {"us": 14.7, "note": "query heads zero-padded 12 -> 16, as vLLM pads them"},
                 "FlashMLA": no_mla}),
            row(8, {"status": "pass", "error_over_bound": 0.5, "bad_tokens": [], "us": 12.0},
                {"status": "fail", "error_over_bound": math.inf, "bad_tokens": [3], "us": 11.5},
                {"FlashInfer": {"us": None, "not_available": "flashinfer.decode.f raised ValueError: no"},
                 "FlashMLA": no_mla})]
    if not timing:
        for r in rows:
            r["peers"] = {}
            for e in r["paths"].values():
                e.pop("us")
    return {"tool": "dsv4-mla-selftest",
            "gpu": {"name": "Test GPU", "capability": [12, 0], "arch": "sm_120a", "sms": 188},
            "software": {"dsv4-sparse-mla": "0.1.0", "torch": "2.13", "flashinfer": "0.7.4", "flash_mla": None},
            "deployment": {"description": "deepseek-v4-flash at TP 4 (16 query heads per GPU)"},
            "tokens": [1, 8], "paths": ["f16", "bf16"], "seed": 0,
            "timing": {"enabled": timing, "unavailable": None}, "rows": rows,
            "kernels": {"expected": {"k1": "aot /opt/aot", "k2": "compile"},
                        "used": {"k1": "aot /opt/aot", "k2": "compiled"}}}


def test_reports_say_what_ran_and_what_failed(tmp_path):
    result = _result()
    line = summary_line(result)
    assert line.startswith("dsv4-mla-selftest: Test GPU (sm_120a, 188 SMs): 1 shape x 2 token counts x 2 paths "
                           "(f16, bf16): accuracy FAIL on 1 of 4 calls (worst out error inf x its bound: bf16 V4-Flash "
                           "16h 128@p64 model1_fp8 T=8)")
    assert "f16 fastest on 1 of 2, bf16 fastest on 1 of 2" in line
    assert "FlashInfer on 1 call: f16 faster on 1, FlashInfer time / ours 1.40x (geomean), not available on 1" in line
    assert "FlashMLA not available (FlashMLA's sparse decode runs on sm_90 / sm_100 only (this GPU: sm_120a))" in line
    assert line.endswith("kernels: 2 variants, 1 from the AOT build in /opt/aot; 1 compiled (JIT)")
    written = write_reports(result, tmp_path / "out")
    data = json.loads(written["json"].read_text())  # strict JSON: the infinite ratio is a string
    assert data["rows"][1]["paths"]["bf16"]["error_over_bound"] == "inf" and data["gpu"]["sms"] == 188
    md = written["markdown"].read_text()
    assert md == markdown(result)
    assert ("| shape | T | f16 err/bound | bf16 err/bound | f16 us | bf16 us | FlashInfer us | FlashMLA us |"
            in md)
    assert "| V4-Flash 16h 128@p64 model1_fp8 | 1 | 0.62 | 0.70 | 10.5 | 11.0 | 14.7 | n/a |" in md
    assert "| V4-Flash 16h 128@p64 model1_fp8 | 8 | 0.50 | **inf FAIL** | 12.0 | 11.5 | n/a | n/a |" in md
    assert "- bf16 V4-Flash 16h 128@p64 model1_fp8 T=8: out error above its bound at tokens [3] (worst inf x" in md
    assert "  - not available on 1 call: flashinfer.decode.f raised ValueError: no" in md
    assert "  - not available on 2 calls: FlashMLA's sparse decode runs on sm_90 / sm_100 only" in md
    assert "  - query heads zero-padded 12 -> 16, as vLLM pads them (1 call)" in md
    assert "  - k2: compiled (JIT)" in md and "k1:" not in md  # the AOT ones are counted, the others named
    if importlib.util.find_spec("matplotlib") is not None:
        assert written["plot"].stat().st_size > 0
    else:
        assert "matplotlib is not installed" in written["plot_skipped"] and "plot" not in written


def test_reports_without_timing():
    result = _result(timing=False)
    line = summary_line(result)
    assert "timing off (--no-timing)" in line and "peers" not in line
    md = markdown(result)
    assert "| shape | T | f16 err/bound | bf16 err/bound |\n" in md and "us |" not in md
    assert "Timing: off (--no-timing)." in md


# ---------------------------------------------------------------------- peers
FLASHINFER_VERSION = "0.7.4"


def _flashinfer_module(monkeypatch, calls: list, *, dsv4=True, mla=True, kv_cache_format=True, raises=None):
    """A stand-in ``flashinfer`` package: ``flashinfer.decode`` with the two functions vLLM
    calls on SM120, of flashinfer-python 0.7.4's signatures (``flashinfer/mla/_core.py``; the
    call shapes of ``dispatch.engines`` take the same parameters, ``tests/test_engine_call_shapes.py``),
    recording each call's arguments (or raising ``raises``)."""
    def trtllm_batch_decode_sparse_mla_dsv4(
            query, swa_kv_cache, workspace_buffer, sparse_indices=None, compressed_kv_cache=None,
            sparse_topk_lens=None, seq_lens=None, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
            kv_layout="HND", cum_seq_lens_q=None, max_q_len=None, enable_pdl=None, swa_topk_lens=None,
            extra_sparse_indices=None, extra_sparse_topk_lens=None, backend="auto", hca_swa_indices=None,
            hca_compressed_block_tables=None, hca_seq_lens=None, hca_is_causal=True, hca_use_persistent=False,
            hca_sparse_indices_format=None, remapped_sparse_indices_buffer=None, sparse_indices_are_storage_offsets=None,
            dsv4_inv_rope_cos_sin_cache=None, dsv4_output_scale=None, sparse_topk_lens_offset=0,
            multi_ctas_kv_counter_buffer=None, *, kv_cache_format="fp8"):
        calls.append(dict(locals()))
        if raises is not None:
            raise raises
        return out

    def older_dsv4(query, swa_kv_cache, workspace_buffer, sparse_indices=None, compressed_kv_cache=None,
                   sparse_topk_lens=None, seq_lens=None, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
                   kv_layout="HND", cum_seq_lens_q=None, max_q_len=None, enable_pdl=None, swa_topk_lens=None,
                   extra_sparse_indices=None, extra_sparse_topk_lens=None, backend="auto"):
        calls.append(dict(locals()))
        return out

    def trtllm_batch_decode_with_kv_cache_mla(
            query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
            seq_lens, max_seq_len, sparse_mla_top_k=0, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
            skip_softmax_threshold_scale_factor=None, enable_pdl=None, backend="auto", is_var_seq=True,
            uses_shared_paged_kv_idx=True, lse=None, return_lse=False, cute_dsl_impl="auto", kv_scale_format="auto",
            cum_seq_lens_q=None, max_q_len=None, multi_ctas_kv_counter_buffer=None, sparse_mla_top_k_lens=None,
            enable_dcp=False, cp_world=1, cp_rank=0, causal_seqlens_kv_global=None, use_fp16_softmax=None,
            return_lse_base=None):
        calls.append(dict(locals()))
        return out

    package, decode = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.decode")
    package.__version__, package.decode = FLASHINFER_VERSION, decode
    if dsv4:
        decode.trtllm_batch_decode_sparse_mla_dsv4 = trtllm_batch_decode_sparse_mla_dsv4 if kv_cache_format \
            else older_dsv4
    if mla:
        decode.trtllm_batch_decode_with_kv_cache_mla = trtllm_batch_decode_with_kv_cache_mla
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    return decode


def _inputs(H=4, T=3, kv_format="model1_fp8", extra_format=None, topk=64, extra_topk=96, sink=True, lengths=True):
    """A ``sparse_mla_decode`` call's inputs on the CPU: q, the cache, the slots and keywords."""
    gen = torch.Generator().manual_seed(7)
    cache = make_cache(4, 64, device="cpu", kv_format=kv_format, gen=gen)
    d_qk = 576 if kv_format == "v32_fp8" else 512
    q = torch.randn(T, H, d_qk, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, 256, (T, topk), generator=gen, dtype=torch.int32)
    kw = {"kv_format": kv_format}
    if lengths:
        kw["topk_length"] = torch.full((T,), topk, dtype=torch.int32)
    if sink:
        kw["attn_sink"] = torch.randn(H, generator=gen)
    if extra_format is not None:
        kw.update(extra_kv_cache=make_cache(16, 2, device="cpu", kv_format=extra_format, gen=gen),
                  extra_indices=torch.randint(0, 32, (T, extra_topk), generator=gen, dtype=torch.int32),
                  extra_kv_format=extra_format)
        if lengths:
            kw["extra_topk_length"] = torch.full((T,), extra_topk - 5, dtype=torch.int32)
    return q, cache, idx, kw


def _timed(call):
    """A stand-in timer: runs the call once and says 7.25 us."""
    call()
    return 7.25


WORKSPACE = torch.zeros(64, dtype=torch.uint8)


def test_flashinfer_gets_the_call_vllm_makes_on_the_same_inputs(monkeypatch):
    calls = []
    decode = _flashinfer_module(monkeypatch, calls)
    q, cache, idx, kw = _inputs(H=4, extra_format="model1_fp8")
    call = flashinfer_call(q, cache, idx, kw=kw, arch="sm_120a", workspace=WORKSPACE)
    assert call.unavailable is None and call.function == "flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4"
    inspect.signature(decode.trtllm_batch_decode_sparse_mla_dsv4).bind(*call.args, **call.kwargs)
    assert time_peer(call, _timed) == {"us": 7.25, "note": "query heads zero-padded 4 -> 8, as vLLM pads them"}
    (got,) = calls
    assert got["query"].shape == (3, 8, 512) and torch.equal(got["query"][:, :4], q)
    assert not got["query"][:, 4:].any()  # vLLM's zero-padded heads
    assert got["swa_kv_cache"] is cache and got["sparse_indices"] is idx and got["workspace_buffer"] is WORKSPACE
    assert got["swa_topk_lens"] is kw["topk_length"] and got["kv_layout"] == "NHD" and got["kv_cache_format"] == "fp8"
    assert got["sinks"].shape == (8,) and torch.equal(got["sinks"][:4], kw["attn_sink"])
    assert got["compressed_kv_cache"] is kw["extra_kv_cache"]
    assert got["extra_sparse_topk_lens"] is kw["extra_topk_length"]
    assert got["extra_sparse_indices"].shape == (3, 1, 96) and torch.equal(got["extra_sparse_indices"][:, 0],
                                                                           kw["extra_indices"])
    assert got["bmm1_scale"] == 512 ** -0.5 and got["bmm2_scale"] == 1.0 and got["backend"] == "auto"
    assert got["out"].shape == (3, 8, 512) and got["out"].dtype == torch.bfloat16
    assert got["sparse_topk_lens"] is None  # FlashInfer's SM100 length, which its SM120 path does not read


@pytest.mark.parametrize("main,extra,pairing", [
    ("model1_nvfp4", None, "nvfp4"), ("v41_fp8", None, "fp8_dsv41"), ("v41_fp8", "v41_nvfp4", "fp8_dsv41_fp4_ca"),
    ("v41_fp8_inline", "v41_nvfp4_inline", "fp8_dsv41_inline_fp4_ca"),
])
def test_flashinfer_is_told_the_cache_pairing(monkeypatch, main, extra, pairing):
    calls = []
    _flashinfer_module(monkeypatch, calls)
    call = flashinfer_call(*_inputs(H=64, kv_format=main, extra_format=extra), arch="sm_121a", workspace=WORKSPACE)
    assert call.note is None and call.kwargs["kv_cache_format"] == pairing and call.kwargs["query"].shape[1] == 64


def test_flashinfer_mla_call_for_the_fp32_scale_rows(monkeypatch):
    calls = []
    _flashinfer_module(monkeypatch, calls)
    q, cache, idx, kw = _inputs(H=16, kv_format="v32_fp8", sink=False, lengths=False)
    call = flashinfer_call(q, cache, idx, kw=kw, arch="sm_120a", workspace=WORKSPACE)
    assert call.function == "flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla"
    assert time_peer(call, _timed) == {"us": 7.25}
    (got,) = calls
    assert got["query"].shape == (3, 1, 16, 576) and got["kv_cache"].shape == (4, 1, 64, 656)
    assert got["kv_cache"].data_ptr() == cache.data_ptr() and got["block_tables"].shape == (3, 1, 64)
    assert (got["kv_lora_rank"], got["qk_rope_head_dim"], got["sparse_mla_top_k"]) == (512, 64, 64)
    assert torch.equal(got["seq_lens"], torch.full((3,), 64, dtype=torch.int32))  # no lengths given: full lists
    assert got["kv_scale_format"] == "pow2_fp32" and got["sinks"] is None and got["bmm1_scale"] == 576 ** -0.5
    q, cache, idx, kw = _inputs(H=16, kv_format="glm_nope_fp8", sink=False)
    glm = flashinfer_call(q, cache, idx, kw=kw, arch="sm_120a", workspace=WORKSPACE)
    assert glm.kwargs["qk_rope_head_dim"] == 0 and glm.kwargs["kv_scale_format"] == "arbitrary_fp32"
    # the rope-free layout's lengths go in sparse_mla_top_k_lens (FlashInfer requires them there)
    assert glm.kwargs["sparse_mla_top_k_lens"] is kw["topk_length"] and glm.kwargs["seq_lens"] is None


def test_flashinfer_says_why_it_does_not_run(monkeypatch):
    calls = []
    _flashinfer_module(monkeypatch, calls)
    inputs = _inputs(H=8)
    assert flashinfer_call(*inputs, arch="sm_90a", workspace=WORKSPACE).unavailable == (
        "FlashInfer's SM120 sparse MLA kernels run on sm_120 / sm_121 only (this GPU: sm_90a)")
    mixed = flashinfer_call(*_inputs(kv_format="model1_fp8", extra_format="model1_nvfp4"), arch="sm_120a",
                            workspace=WORKSPACE)
    assert mixed.unavailable == "FlashInfer has no kv_cache_format for a model1_fp8 cache with a model1_nvfp4 " \
                                "compressed cache"
    assert "at most 128" in flashinfer_call(*_inputs(H=192), arch="sm_120a", workspace=WORKSPACE).unavailable
    assert time_peer(mixed, _timed) == {"us": None, "not_available": mixed.unavailable} and not calls
    _flashinfer_module(monkeypatch, calls, kv_cache_format=False)  # a release before kv_cache_format
    assert flashinfer_call(*inputs, arch="sm_120a", workspace=WORKSPACE).unavailable is None
    assert "has no kv_cache_format: it reads MODEL1 FP8 caches only (this shape: model1_nvfp4)" in flashinfer_call(
        *_inputs(kv_format="model1_nvfp4"), arch="sm_120a", workspace=WORKSPACE).unavailable
    _flashinfer_module(monkeypatch, calls, dsv4=False)
    assert flashinfer_call(*inputs, arch="sm_120a", workspace=WORKSPACE).unavailable == (
        f"flashinfer {FLASHINFER_VERSION} has no trtllm_batch_decode_sparse_mla_dsv4")
    _flashinfer_module(monkeypatch, calls, raises=ValueError("Expected 8, 16, 32, 64, or 128 query heads\nmore"))
    refused = time_peer(flashinfer_call(*inputs, arch="sm_120a", workspace=WORKSPACE), _timed)
    assert refused == {"us": None, "not_available": "flashinfer.decode.trtllm_batch_decode_sparse_mla_dsv4 raised "
                                                    "ValueError: Expected 8, 16, 32, 64, or 128 query heads"}
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed: its import fails
    assert (flashinfer_call(*inputs, arch="sm_120a", workspace=WORKSPACE).unavailable
            == "not installed: pip install flashinfer-python")


def _flash_mla_module(monkeypatch, calls: list):
    """A stand-in ``flash_mla`` of FlashMLA's sparse-decode interface (``get_mla_metadata()``
    returning an empty scheduler state that the first call fills)."""
    class FlashMLASchedMeta:
        have_initialized = False

    def get_mla_metadata(*args, **kwargs):
        return FlashMLASchedMeta(), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                               attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                               extra_topk_length=None):
        calls.append(dict(locals()))
        tile_scheduler_metadata.have_initialized = True
        return q.new_empty(*q.shape[:-1], head_dim_v), None

    module = types.ModuleType("flash_mla")
    module.get_mla_metadata, module.flash_mla_with_kvcache = get_mla_metadata, flash_mla_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    return FlashMLASchedMeta


def test_flashmla_gets_its_sparse_fp8_call_with_heads_padded_to_64(monkeypatch):
    calls = []
    sched_type = _flash_mla_module(monkeypatch, calls)
    q, cache, idx, kw = _inputs(H=16, extra_format="model1_fp8")
    call = flashmla_call(q, cache, idx, kw=kw, arch="sm_90a")
    assert time_peer(call, _timed) == {"us": 7.25, "note": "query heads zero-padded 16 -> 64, as vLLM and SGLang pad "
                                                           "them"}
    (got,) = calls
    assert got["q"].shape == (3, 1, 64, 512) and torch.equal(got["q"][:, 0, :16], q) and not got["q"][:, :, 16:].any()
    assert got["k_cache"] is cache and got["block_table"] is None and got["cache_seqlens"] is None
    assert got["head_dim_v"] == 512 and isinstance(got["tile_scheduler_metadata"], sched_type)
    assert got["is_fp8_kvcache"] is True and got["causal"] is False and got["softmax_scale"] == 512 ** -0.5
    assert got["indices"].shape == (3, 1, 64) and got["topk_length"] is kw["topk_length"]
    assert got["attn_sink"].shape == (64,) and torch.equal(got["attn_sink"][:16], kw["attn_sink"])
    assert got["extra_k_cache"] is kw["extra_kv_cache"] and got["extra_indices_in_kvcache"].shape == (3, 1, 96)
    assert got["extra_topk_length"] is kw["extra_topk_length"]
    v32 = flashmla_call(*_inputs(H=128, kv_format="v32_fp8", sink=False), arch="sm_90a")
    assert v32.note is None and v32.args[0].shape == (3, 1, 128, 576)


def test_flashmla_says_why_it_does_not_run(monkeypatch):
    _flash_mla_module(monkeypatch, [])
    assert flashmla_call(*_inputs(H=64), arch="sm_120a").unavailable == (
        "FlashMLA's sparse decode runs on sm_90 / sm_100 only (this GPU: sm_120a)")
    assert flashmla_call(*_inputs(H=64, kv_format="v41_fp8"), arch="sm_90a").unavailable.startswith(
        "FlashMLA reads model1_fp8 and v32_fp8 caches")
    assert "not model1_fp8 + model1_nvfp4" in flashmla_call(*_inputs(H=64, extra_format="model1_nvfp4"),
                                                            arch="sm_90a").unavailable
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    assert flashmla_call(*_inputs(H=64), arch="sm_90a").unavailable.startswith("not installed")
    called = peer_calls(*_inputs(H=64), arch="sm_90a", workspace=WORKSPACE)
    assert [c.peer for c in called] == ["FlashInfer", "FlashMLA"]


# ---------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_quick_selftest_on_the_gpu(tmp_path, capsys):
    from dispatch.policy.precision import format_precisions
    from tests.conftest import gpu_target

    status = selftest.main(["--model", "glm-5.3", "--tp", "4", "--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "dsv4-mla-selftest.json").read_text())
    assert status == selftest.EXIT_OK == data["exit_status"]
    assert (tmp_path / "dsv4-mla-selftest.md").read_text().startswith("# dsv4-mla-selftest")
    rows = data["rows"]
    assert [r["num_tokens"] for r in rows] == list(selftest.QUICK_TOKENS)
    assert all(r["num_heads"] == 16 and r["kv_format"] == "glm_nope_fp8" for r in rows)
    # the GPU's paths (an arch profile's: its target's) for GLM-5.3's rows, the default first
    assert data["paths"][0] == "f16" and set(data["paths"]) == set(format_precisions(gpu_target().name, "glm_nope_fp8"))
    # and, by the arch's own facts, every path the GPU has an instruction for: "f16" and "bf16"
    # everywhere, "fp8" where the arch has the e4m3 MMA
    assert set(data["paths"]) >= {"f16", "bf16"} | ({"fp8"} if gpu_target().e4m3_mma else set())
    for r in rows:
        assert set(r["paths"]) == set(data["paths"]) and set(r["peers"]) == {"FlashInfer", "FlashMLA"}
        for entry in r["paths"].values():
            assert entry["status"] == "pass" and 0 <= entry["error_over_bound"] <= 1 and entry["us"] > 0
        for entry in r["peers"].values():
            assert (entry["us"] or 0) > 0 or entry["not_available"]
    used = data["kernels"]["used"]
    assert used and set(used) == set(data["kernels"]["expected"]) and "not loaded" not in used.values()
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("dsv4-mla-selftest: ") and "accuracy PASS" in out


# ---------------------------------------------------------------------- Ampere and Ada
@pytest.mark.parametrize("capability,arch,paths", [((8, 0), "sm_80", ["f16", "bf16"]), ((8, 6), "sm_86", ["f16", "bf16"]),
                                                   ((8, 7), "sm_80", ["f16", "bf16"]),
                                                   ((8, 9), "sm_89", ["f16", "bf16", "fp8"])])
def test_an_8x_gpu_is_found_with_its_own_paths_and_the_peers_say_they_do_not_run_there(capability, arch, paths,
                                                                                        monkeypatch, capsys):
    """On a compute capability 8.x GPU (the device stood in for on the CPU): found as its target
    (8.7, Orin, as sm_80), its cases take the arch's paths only (no "fp8" without the e4m3 MMA),
    ``--precision fp8`` is refused naming them, and FlashInfer's and FlashMLA's calls say they
    do not run there."""
    from dispatch import api

    props = types.SimpleNamespace(major=capability[0], minor=capability[1], multi_processor_count=84,
                                  shared_memory_per_multiprocessor=102400)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in 8.x GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("DSV4_MLA_ARCH_PROFILE", raising=False)
    api.device_target.cache_clear()
    try:
        gpu, status, line = selftest.find_gpu()
    finally:
        api.device_target.cache_clear()
    assert status is None and line is None and gpu["arch"] == arch and gpu["capability"] == list(capability)
    cases = selftest.make_cases(select_deployment("glm-5.3", 4), tokens=(1,), arch=arch, wanted=None, seed=0,
                                device="cpu")
    assert cases and all(case.paths == paths for case in cases)
    if "fp8" not in paths:
        args = selftest.build_parser().parse_args(["--model", "glm-5.3", "--precision", "fp8"])
        assert selftest.run(args, select_deployment("glm-5.3", 1), gpu) == ({}, selftest.EXIT_USAGE)
        assert f"--precision fp8: not a compute path of {arch} (its paths: f16, bf16)" in capsys.readouterr().err
    assert flashinfer_call(*_inputs(H=64), arch=arch, workspace=WORKSPACE).unavailable == (
        f"FlashInfer's SM120 sparse MLA kernels run on sm_120 / sm_121 only (this GPU: {arch})")
    assert flashmla_call(*_inputs(H=64), arch=arch).unavailable == (
        f"FlashMLA's sparse decode runs on sm_90 / sm_100 only (this GPU: {arch})")
