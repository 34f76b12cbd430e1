"""What ``dsv4-mla-selftest`` writes: the JSON of a run, its Markdown report, the plot of time
per shape and the one-line summary, all from the run's result (a plain dict, module
``dispatch.tools.selftest``), so that each can be made and checked without a GPU.

A result holds ``gpu`` (name, capability, arch, sms), ``software``, ``deployment``
(``description``), ``tokens``, ``paths`` (the compute paths run), ``timing`` (``enabled``,
``unavailable``), ``rows`` and ``kernels`` (``expected`` / ``used``: variant name -> where it
comes from, as ``dispatch.runtime.loader.sources`` says it). A row is one shape at one token count:
``shape`` (its label), ``num_tokens``, ``paths`` (per path: ``status`` "pass" | "fail" |
"error", ``error_over_bound``, ``bad_tokens``, ``error``, ``us``) and ``peers`` (per peer:
``us`` or ``not_available``, and a ``note``).
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from pathlib import Path

from cute_kernels.sparse_mla_decode.tuning import DEFAULT_PRECISION

from ..runtime.loader import PACKAGE_AOT_DIR
from .selftest_peers import PEERS

PROG = "dsv4-mla-selftest"
FILE_STEM = PROG  # dsv4-mla-selftest.json / .md / .png in --out


# ---------------------------------------------------------------------- reading a result
def path_entries(rows: list[dict]):
    """(row, path, entry) of every path run on every row."""
    for row in rows:
        for path, entry in row["paths"].items():
            yield row, path, entry


def failures(rows: list[dict]) -> list[tuple[dict, str, dict]]:
    """The (row, path, entry) whose accuracy check did not pass (above the bound, or raised)."""
    return [(row, path, e) for row, path, e in path_entries(rows) if e["status"] != "pass"]


def _ratio(entry: dict) -> float | None:
    value = entry.get("error_over_bound")
    return None if value is None else float(value)


def worst(rows: list[dict]):
    """(ratio, row, path) of the largest error / bound among the checked calls, or None."""
    checked = [(_ratio(e), row, path) for row, path, e in path_entries(rows) if _ratio(e) is not None]
    return max(checked, key=lambda c: c[0]) if checked else None


def _us(entry: dict | None) -> float | None:
    value = None if entry is None else entry.get("us")
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def fastest(rows: list[dict]) -> collections.Counter:
    """Per compute path, on how many rows it was the fastest path (rows with a time)."""
    counts = collections.Counter()
    for row in rows:
        times = {path: _us(e) for path, e in row["paths"].items() if _us(e) is not None}
        if times:
            counts[min(times, key=times.get)] += 1
    return counts


def reference_path(row: dict) -> str:
    """The path a peer is compared with: the default (``tuning.DEFAULT_PRECISION``) where it ran."""
    return DEFAULT_PRECISION if DEFAULT_PRECISION in row["paths"] else next(iter(row["paths"]))


def peer_stats(rows: list[dict], peer: str) -> dict:
    """A peer over the rows: how many rows it ran on, ``ours_faster`` (rows where this library's
    reference path took less time), ``geomean`` of peer time / ours, the notes and the reasons
    it did not run (each with its count)."""
    ratios, notes, reasons = [], collections.Counter(), collections.Counter()
    for row in rows:
        entry = row["peers"].get(peer)
        if entry is None:
            continue
        ours, theirs = _us(row["paths"].get(reference_path(row))), _us(entry)
        if theirs is None:
            reasons[entry.get("not_available") or "not timed"] += 1
            continue
        if entry.get("note"):
            notes[entry["note"]] += 1
        if ours is not None:
            ratios.append(theirs / ours)
    geomean = statistics.geometric_mean(ratios) if ratios else None
    return {"measured": len(ratios), "ours_faster": sum(r > 1 for r in ratios), "geomean": geomean,
            "notes": dict(notes), "reasons": dict(reasons)}


def source_kind(source: str) -> str:
    """A kernel's source (``loader.sources``' words, or ``selftest.expected_source``'s) as a
    phrase: from which AOT build, from the JIT disk cache, compiled now, or to compile."""
    if source.startswith("aot "):
        directory = source[4:]
        wheel = Path(directory).resolve() == PACKAGE_AOT_DIR.resolve()
        return f"from the AOT build in {directory}" + (" (the installed package's)" if wheel else "")
    if source.startswith("jit disk cache "):
        return f"from the JIT disk cache ({source[15:]})"
    return {"compiled": "compiled (JIT)", "compile": "to compile (JIT)"}.get(source, source)


def source_counts(sources: dict[str, str]) -> collections.Counter:
    """How many variants come from each source (``source_kind``)."""
    return collections.Counter(source_kind(s) for s in sources.values())


def counts_text(counts: collections.Counter) -> str:
    """``source_counts`` in words: "30 from the AOT build in DIR; 2 compiled (JIT)"."""
    return "; ".join(f"{n} {kind}" for kind, n in counts.most_common())


# ---------------------------------------------------------------------- the summary line
def times_text(ratio: float) -> str:
    """An error / bound ratio as a multiple: "0.62x", "inf x" (a token whose bound is 0, not met)."""
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "inf x"


def _ratio_text(entry: dict) -> str:
    ratio = _ratio(entry)
    return "inf" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def gpu_text(gpu: dict) -> str:
    return f"{gpu['name']} ({gpu['arch']}, {gpu['sms']} SMs)"


def _row_label(row: dict) -> str:
    return f"{row['shape']} T={row['num_tokens']}"


def _peer_text(rows: list[dict], peer: str) -> str:
    stats = peer_stats(rows, peer)
    if not stats["measured"]:
        if not stats["reasons"]:
            return f"{peer} not timed"
        reason = max(stats["reasons"], key=stats["reasons"].get)
        return f"{peer} not available ({reason})"
    text = (f"{peer} on {_plural(stats['measured'], 'call')}: {DEFAULT_PRECISION} faster on {stats['ours_faster']}, "
            f"{peer} time / ours {stats['geomean']:.2f}x (geomean)")
    missing = sum(stats["reasons"].values())
    return text + (f", not available on {missing}" if missing else "")


def summary_line(result: dict) -> str:
    """The one line a run ends with: the GPU, what ran, the accuracy verdict and its worst case,
    the fastest path, the peers and where the kernels came from."""
    rows = result["rows"]
    shapes = len({row["shape"] for row in rows})
    failed = failures(rows)
    top = worst(rows)
    verdict = f"accuracy FAIL on {len(failed)} of {sum(1 for _ in path_entries(rows))} calls" if failed \
        else "accuracy PASS"
    if top is not None:
        ratio, row, path = top
        verdict += f" (worst out error {times_text(ratio)} its bound: {path} {_row_label(row)})"
    parts = [f"{PROG}: {gpu_text(result['gpu'])}: {_plural(shapes, 'shape')} x "
             f"{_plural(len(result['tokens']), 'token count')} x {_plural(len(result['paths']), 'path')} "
             f"({', '.join(result['paths'])}): {verdict}"]
    if result["timing"]["enabled"]:
        counts = fastest(rows)
        timed = sum(counts.values())
        if counts:
            parts.append(", ".join(f"{p} fastest on {n} of {timed}" for p, n in counts.most_common()))
        parts.append("peers: " + ", ".join(_peer_text(rows, peer) for peer in PEERS))
    else:
        parts.append("timing " + (result["timing"].get("unavailable") or "off (--no-timing)"))
    used = result["kernels"]["used"]
    parts.append(f"kernels: {len(used)} variants, " + (counts_text(source_counts(used)) or "none loaded"))
    return "; ".join(parts)


# ---------------------------------------------------------------------- Markdown
def _ratio_cell(entry: dict | None) -> str:
    if entry is None:
        return "-"
    if entry["status"] == "error":
        return "**error**"
    return _ratio_text(entry) if entry["status"] == "pass" else f"**{_ratio_text(entry)} FAIL**"


def _us_cell(entry: dict | None, peer: bool = False) -> str:
    if entry is None:
        return "-"
    us = _us(entry)
    if us is None:
        return "n/a" if peer else "-"
    return f"{us:.1f}"


def results_table(result: dict) -> str:
    """The Markdown table: a row per shape and token count; each path's error / bound, then
    (with timing) each path's and each peer's microseconds per call."""
    paths, timed = result["paths"], result["timing"]["enabled"]
    head = ["shape", "T"] + [f"{p} err/bound" for p in paths]
    if timed:
        head += [f"{p} us" for p in paths] + [f"{peer} us" for peer in PEERS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in result["rows"]:
        cells = [row["shape"], str(row["num_tokens"])] + [_ratio_cell(row["paths"].get(p)) for p in paths]
        if timed:
            cells += [_us_cell(row["paths"].get(p)) for p in paths]
            cells += [_us_cell(row["peers"].get(peer), peer=True) for peer in PEERS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The whole report: the GPU and software, the summary, the table, the failures, the peers
    and the kernels' sources."""
    gpu, sw = result["gpu"], result["software"]
    versions = ", ".join(f"{name} {version or 'not installed'}" for name, version in sw.items())
    out = [f"# {PROG}", "",
           f"- GPU: {gpu_text(gpu)}, compute capability {'.'.join(map(str, gpu['capability']))}",
           f"- Software: {versions}",
           f"- Deployment: {result['deployment']['description']}; tokens per call "
           f"{', '.join(map(str, result['tokens']))}; seed {result['seed']}",
           f"- Summary: {summary_line(result).removeprefix(PROG + ': ')}", "",
           "## Results", "", results_table(result), "",
           "err/bound: the worst checked token's relative L2 error of out against the float64 reference, over its "
           "bound (`dispatch.tools.accuracy`: twice the rounding floor of the case; above 1 fails). "
           + ("us: microseconds per call, replayed from a CUDA graph with L2 cleared before every call, median "
              "(`dispatch.tools.timing`). " if result["timing"]["enabled"] else "")
           + "-: the path does not read the shape's cache format. n/a: the peer did not run (Peers)."]
    failed = failures(result["rows"])
    if failed:
        out += ["", "## Failures", ""]
        for row, path, entry in failed:
            what = entry.get("error") or (f"out error above its bound at tokens {entry.get('bad_tokens', [])[:8]} "
                                          f"(worst {times_text(_ratio(entry))} the bound)")
            out.append(f"- {path} {_row_label(row)}: {what}")
    if result["timing"]["enabled"]:
        out += ["", "## Peers", ""]
        for peer in PEERS:
            stats = peer_stats(result["rows"], peer)
            line = f"- {peer}: measured on {stats['measured']} of {_plural(len(result['rows']), 'call')}"
            if stats["measured"]:
                line += (f"; {DEFAULT_PRECISION} faster on {stats['ours_faster']}, {peer} time / ours "
                         f"{stats['geomean']:.2f}x (geomean)")
            out.append(line)
            out += [f"  - {note} ({_plural(n, 'call')})" for note, n in stats["notes"].items()]
            out += [f"  - not available on {_plural(n, 'call')}: {reason}" for reason, n in stats["reasons"].items()]
    else:
        out += ["", f"Timing: {result['timing'].get('unavailable') or 'off (--no-timing)'}."]
    out += ["", "## Kernels", ""]
    expected, used = result["kernels"]["expected"], result["kernels"]["used"]
    out.append(f"- Before the run: {len(expected)} variants, {counts_text(source_counts(expected)) or 'none'}")
    out.append(f"- Used: {len(used)} variants, {counts_text(source_counts(used)) or 'none loaded'}")
    out += [f"  - {name}: {source_kind(source)}" for name, source in sorted(used.items())
            if not source.startswith("aot ")]  # the prebuilt ones are counted, the others named
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- files
def _json_safe(value):
    """``value`` with every non-finite float as a string ("inf", "nan"): strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(result: dict) -> str:
    return json.dumps(_json_safe(result), indent=1, allow_nan=False)


def write_plot(result: dict, path: Path) -> str | None:
    """A bar chart of time per call: one group per shape and token count, one bar per path and
    peer that has a time. Returns None when written, else why not."""
    if not result["timing"]["enabled"]:
        return "no times (--no-timing)"
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'dsv4-sparse-mla[plot]')"
    rows = result["rows"]
    series = [(p, [_us(row["paths"].get(p)) for row in rows]) for p in result["paths"]]
    series += [(peer, [_us(row["peers"].get(peer)) for row in rows]) for peer in PEERS]
    series = [(name, values) for name, values in series if any(v is not None for v in values)]
    if not series:
        return "no call was timed"
    # one horizontal group per shape and token count, its label beside it (readable at any
    # count of rows), a log time axis (times span 10 us to milliseconds); a bar 0.07 inch
    # high, within what one image holds (matplotlib's limit is 2**16 pixels)
    height = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(10, min(max(4.0, 0.07 * len(rows) * len(series) + 1.5), 500.0)))
    for i, (name, values) in enumerate(series):
        ys = [y + i * height for y, v in enumerate(values) if v is not None]
        ax.barh(ys, [v for v in values if v is not None], height, label=name)
    ax.set_yticks([y + 0.4 - height / 2 for y in range(len(rows))])
    ax.set_yticklabels([_row_label(row) for row in rows], fontsize=7)
    ax.set_ylim(len(rows), -height)  # the first row on top, as in the Markdown table
    ax.set_xscale("log")
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.set_xlabel("us per call (CUDA graph replay, L2 cleared, median; log scale)")
    ax.set_title(f"{PROG}: {gpu_text(result['gpu'])}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the longest labels whole
    plt.close(fig)
    return None


def write_reports(result: dict, out_dir: str | Path) -> dict:
    """Write ``dsv4-mla-selftest.json`` / ``.md`` / ``.png`` into ``out_dir`` (created where
    missing). Returns the paths written and, under "plot_skipped", why the plot was not."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {"json": out_dir / f"{FILE_STEM}.json", "markdown": out_dir / f"{FILE_STEM}.md"}
    written["json"].write_text(to_json(result) + "\n")
    written["markdown"].write_text(markdown(result))
    png = out_dir / f"{FILE_STEM}.png"
    skipped = write_plot(result, png)
    if skipped is None:
        written["plot"] = png
    else:
        written["plot_skipped"] = skipped
    return written
