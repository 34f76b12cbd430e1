"""scripts/bench_compare.py: each shape's minimum over its runs, and the geometric mean."""

import json
import math

import pytest

from scripts.bench_compare import compare, load_runs


def _write(path, rows):
    path.write_text(json.dumps({"device": "test", "copy_gbs": 1.0, "rows": rows}))
    return str(path)


def test_minimum_per_shape_and_geometric_mean(tmp_path):
    old = [_write(tmp_path / "o1.json", [dict(T=1, H=16, topk="128", us=10.0), dict(T=8, H=64, topk="128+512", us=20.0)]),
           _write(tmp_path / "o2.json", [dict(T=1, H=16, topk="128", us=9.0), dict(T=8, H=64, topk="128+512", us=22.0)])]
    new = [_write(tmp_path / "n1.json", [dict(T=1, H=16, topk="128", us=9.9), dict(T=8, H=64, topk="128+512", us=25.0)]),
           _write(tmp_path / "n2.json", [dict(T=1, H=16, topk="128", us=9.9), dict(T=8, H=64, topk="128+512", us=10.0),
                                         dict(T=64, H=16, topk="512", us=1.0)])]  # only on one side: left out
    rows, geomean = compare(load_runs(old), load_runs(new))
    assert [r[0] for r in rows] == [(1, 16, "128"), (8, 64, "128+512")]
    assert [(r[1], r[2]) for r in rows] == [(9.0, 9.9), (20.0, 10.0)]
    assert rows[0][4] == [10.0, 9.0] and rows[1][5] == [25.0, 10.0]
    assert geomean == pytest.approx(math.sqrt(1.1 * 0.5))


def test_no_common_shape_is_an_error(tmp_path):
    old = load_runs([_write(tmp_path / "o.json", [dict(T=1, H=16, topk="128", us=1.0)])])
    new = load_runs([_write(tmp_path / "n.json", [dict(T=1, H=64, topk="128", us=1.0)])])
    with pytest.raises(SystemExit, match="no shape"):
        compare(old, new)
