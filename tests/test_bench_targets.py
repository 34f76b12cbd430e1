"""scripts/bench_targets.py: which shapes each target covers, its limits as times, the tensor
rate a missed shape would need, and the report of a bench JSON (arithmetic only, no GPU)."""

import json

import pytest

from scripts.bench_targets import TARGETS, checks, main, report


def _row(T, H, topk, us, flashmla_us=None, torch_us=float("nan")):
    return dict(T=T, H=H, topk=topk, us=us, flashmla_us=flashmla_us, torch_us=torch_us)


BENCH = dict(device="test GPU", mma_tflops=600.0, conv_tflops={"16": 400.0, "32": 500.0}, rows=[
    _row(1, 16, "128", 9.9, flashmla_us=15.1, torch_us=144.0),
    _row(1, 128, "1024", 12.0, flashmla_us=18.2, torch_us=100.0),
    _row(64, 128, "1024", 88.8, flashmla_us=51.1),
    _row(64, 16, "128+512", 23.7, flashmla_us=47.8),
    _row(256, 64, "128", 40.5),
])


def _by(target):
    return {(c.T, c.H, c.topk): c for c in checks(BENCH) if c.target == target}


def test_each_target_covers_its_shapes():
    assert set(_by("flashmla")) == {(1, 16, "128"), (1, 128, "1024"), (64, 128, "1024"), (64, 16, "128+512")}
    assert set(_by("flashmla_h16")) == {(1, 16, "128"), (64, 16, "128+512")}
    assert set(_by("t1_under_12us")) == {(1, 16, "128"), (1, 128, "1024")}
    # 64 tokens with at least 512 entries, the extra list's counted: 128+512 is 640
    assert set(_by("t64_1000gbs")) == {(64, 128, "1024"), (64, 16, "128+512")}
    # only where the torch reference was timed (NaN: a --no-torch run)
    assert set(_by("torch_10x")) == {(1, 16, "128"), (1, 128, "1024")}


def test_limits_and_verdicts():
    h16 = _by("flashmla_h16")
    assert h16[1, 16, "128"].allowed_us == pytest.approx(15.1 / 1.5)
    assert h16[1, 16, "128"].met  # 9.9 <= 10.07
    assert h16[64, 16, "128+512"].met  # 23.7 <= 31.9
    t1 = _by("t1_under_12us")
    assert t1[1, 16, "128"].met
    assert not t1[1, 128, "1024"].met  # "under 12 us": 12.0 itself misses
    assert not _by("flashmla")[64, 128, "1024"].met
    assert not _by("torch_10x")[1, 128, "1024"].met  # 100 / 12 = 8.3x
    assert _by("torch_10x")[1, 16, "128"].met
    assert _by("t64_1000gbs")[64, 16, "128+512"].met  # 1009 GB/s


def test_bandwidth_limit_and_needed_rate():
    c = _by("t64_1000gbs")[64, 128, "1024"]
    # 64 x 1024 rows of 584 bytes at 1000 GB/s
    assert c.allowed_us == pytest.approx(64 * 1024 * 584 / 1e9 / 1e3 * 1e6)
    # QK (512 dims) and PV (512 columns) per head and entry, over that time
    assert c.need_tflops == pytest.approx(2 * 64 * 128 * 1024 * 1024 / (c.allowed_us * 1e-6) / 1e12)
    assert not c.met
    f = _by("flashmla")[64, 128, "1024"]
    assert f.need_tflops == pytest.approx(2 * 64 * 128 * 1024 * 1024 / 51.1e-6 / 1e12)


def test_report_lists_each_target_and_each_miss(tmp_path, capsys):
    text = report(BENCH)
    for target in TARGETS:
        assert target in text
    assert "flashmla: 3 of 4 shapes meet it" in text
    assert "t1_under_12us: 1 of 2 shapes meet it" in text
    missed = [line for line in text.splitlines() if line.lstrip().startswith("missed")]
    # flashmla, t1, t64 and torch at 64 x 128 x 1024 / 1 x 128 x 1024; 64 x 16 x 128+512 is
    # 64 x 640 x 584 bytes in 23.7 us = 1009 GB/s: it meets t64 (test_limits_and_verdicts)
    assert len(missed) == 4
    # the needed rate against each ceiling of the run: 336 TFLOP/s at 51.1 us
    line = next(m for m in missed if "64 x 128 x     1024" in m and "51.1" in m)
    assert "56%mma" in line and "84%conv16" in line and "67%conv32" in line
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.strip() == text
