"""The float64 reference against an independent brute-force loop (CPU), every cache format.

The brute force reads each selected slot's bytes itself (the byte layout of each format, from
its specification, flat-row addressing included; e4m3, e2m1, UE8M0, E4M3, FP32 and bf16
decoded in plain Python, exact in float64), then loops over tokens, heads and entries. It
shares nothing with the cache readers or the reference.
"""

import math
import struct

import pytest
import torch

from cute_kernels.sparse_mla_decode.cache_view import default_block_stride, read_cache_view
from cute_kernels.sparse_mla_decode.cache_writers import pack_latent
from cute_kernels.sparse_mla_decode.kv_format import get_format
from cute_kernels.sparse_mla_decode.reference import reference_decode
from dispatch.tools.sample_inputs import make_cache, make_indices
from tests.fp_spec import e4m3_value
from tests.tolerances import seed_for

# the byte layout of each format (its specification, written out here): d_qk, nope dims, scale
# group, nope element ("e4m3" a byte, "e2m1" two to a byte, element 2i in the low nibble), scale
# kind ("ue8m0" byte b: 2**(b - 127); "e4m3" byte; "fp32" little-endian), placement (footer: the
# P data rows of ``row`` bytes, then P records of ``record`` bytes; inline: at ``scale_at`` in the
# row), rope offset in the row, flat rows (an index is row r // R, r % R, R = block / row stride)
SPEC = {
    "model1_fp8": dict(d_qk=512, nope=448, group=64, elem="e4m3", scale="ue8m0", footer=True, row=576, record=8,
                       rope_at=448),
    "model1_nvfp4": dict(d_qk=512, nope=448, group=16, elem="e2m1", scale="e4m3", footer=True, row=352, record=32,
                         rope_at=224),
    "v32_fp8": dict(d_qk=576, nope=512, group=128, elem="e4m3", scale="fp32", footer=False, scale_at=512, rope_at=528),
    "glm_nope_fp8": dict(d_qk=512, nope=512, group=128, elem="e4m3", scale="fp32", footer=False, scale_at=512,
                         rope_at=528),
    "v41_fp8": dict(d_qk=512, nope=512, group=32, elem="e4m3", scale="ue8m0", footer=True, row=512, record=16,
                    rope_at=512),
    "v41_fp8_inline": dict(d_qk=512, nope=512, group=32, elem="e4m3", scale="ue8m0", footer=False, scale_at=512,
                           rope_at=528, flat=True),
    "v41_nvfp4": dict(d_qk=512, nope=512, group=16, elem="e2m1", scale="e4m3", footer=True, row=256, record=32,
                      rope_at=256),
    "v41_nvfp4_inline": dict(d_qk=512, nope=512, group=16, elem="e2m1", scale="e4m3", footer=False, scale_at=256,
                             rope_at=288, flat=True),
}
D_V = 512  # every format's
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _scale(kind: str, raw: bytes, at: int, g: int) -> float:
    if kind == "ue8m0":
        return 2.0 ** (raw[at + g] - 127)
    if kind == "e4m3":
        return e4m3_value(raw[at + g])
    return struct.unpack("<f", raw[at + 4 * g:at + 4 * g + 4])[0]


def _element(elem: str, raw: bytes, row: int, i: int) -> float:
    if elem == "e4m3":
        return e4m3_value(raw[row + i])
    nibble = raw[row + i // 2] >> 4 if i % 2 else raw[row + i // 2] & 0xF
    return -E2M1[nibble & 7] if nibble & 8 else E2M1[nibble]


def slot_reader(cache: torch.Tensor, kv_format: str):
    """(A function index -> the dequantized latent (list of d_qk Python floats, exact), the
    number of indices) of an NHD or HND view ``cache`` of ``kv_format`` (page, block and row
    strides from its strides)."""
    spec = SPEC[kv_format]
    raw = bytes(cache.untyped_storage().cpu())
    base = cache.storage_offset()
    nb = cache.shape[0]
    page = cache.shape[1] if cache.shape[2] == 1 else cache.shape[2]
    block_stride = cache.stride(0)
    row_stride = cache.stride(1) if cache.shape[2] == 1 else cache.stride(2)
    if page == 1:
        row_stride = block_stride if spec.get("flat") else 0
    rows = block_stride // row_stride if spec.get("flat") else page  # the index's divisor
    num_slots = (nb - 1) * rows + page

    def read(slot: int) -> list:
        assert 0 <= slot < num_slots
        block = base + (slot // rows) * block_stride
        t = slot % rows
        if spec["footer"]:
            row = block + t * spec["row"]
            scale_at = block + page * spec["row"] + t * spec["record"]
        else:
            row = block + t * row_stride
            scale_at = row + spec["scale_at"]
        nope = [_element(spec["elem"], raw, row, i) * _scale(spec["scale"], raw, scale_at, i // spec["group"])
                for i in range(spec["nope"])]
        at = row + spec["rope_at"]
        rope = [struct.unpack("<f", b"\0\0" + raw[at + 2 * r:at + 2 * r + 2])[0]
                for r in range(spec["d_qk"] - spec["nope"])]
        return nope + rope

    return read, num_slots


def brute_force(q, lists, sm_scale, d_v, sink=None):
    """``lists``: [(read, num_slots, indices [T, k], lengths [T] or None)] (main, then extra);
    one token, one head, one entry at a time, in float64. V is the latent's first d_v dims."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, d_v, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        picked = []
        for read, num_slots, idx, lens in lists:
            n = idx.shape[1] if lens is None else min(max(int(lens[t]), 0), idx.shape[1])
            for j in range(n):
                s = int(idx[t, j])
                if 0 <= s < num_slots:
                    picked.append(read(s))
        for h in range(H):
            if not picked:
                lse[t, h] = math.inf
                continue
            qh = q[t, h].double().tolist()
            scores = [sm_scale * math.fsum(a * b for a, b in zip(qh, k)) for k in picked]
            m = max(scores)
            weights = [math.exp(s - m) for s in scores]
            total = math.fsum(weights)
            lse[t, h] = m + math.log(total)
            o = [math.fsum(w * k[d] for w, k in zip(weights, picked)) / total for d in range(d_v)]
            gate = 1.0
            if sink is not None:
                sk = float(sink[h])
                gate = 0.0 if sk == math.inf else 1.0 if sk == -math.inf else 1.0 / (1.0 + math.exp(sk - lse[t, h]))
            out[t, h] = torch.tensor(o, dtype=torch.float64) * gate
    return out, lse


def assert_matches(out, lse, bout, blse, what=""):
    assert out.dtype == lse.dtype == torch.float64
    assert torch.equal(torch.isposinf(lse), torch.isposinf(blse)), what
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{what}: NaN"
    fin = torch.isfinite(blse)
    assert torch.allclose(lse[fin], blse[fin], rtol=1e-12, atol=1e-12), what
    assert torch.allclose(out, bout, rtol=1e-10, atol=1e-12), f"{what}: max diff {(out - bout).abs().max().item()}"


# (format, writer, row stride, block padding in bytes, page)
FORMAT_CASES = [
    ("model1_fp8", None, None, 0, 16),
    ("model1_fp8", "flashmla", None, 1024, 5),
    ("model1_nvfp4", None, None, 48, 8),
    ("v32_fp8", "flashmla", None, 0, 16),  # power-of-two FP32 scales
    ("v32_fp8", "vllm", 672, 48, 7),  # max(amax / 448, FLT_MIN): not powers of two; padded rows, page gaps
    ("v32_fp8", "sglang", 656, 0, 1),
    ("glm_nope_fp8", "vllm", 528, 0, 16),
    ("glm_nope_fp8", "b12x", 656, 160, 3),  # 528-byte rows in 656-byte pool rows
    ("v41_fp8", "flashinfer", None, 0, 16),
    ("v41_fp8", "b12x", None, 1024, 5),
    ("v41_fp8_inline", "flashinfer", None, 0, 16),
    ("v41_fp8_inline", "b12x", 544, 2 * 544, 3),  # flat rows: blocks of 3 tokens padded to 5 rows
    ("v41_fp8_inline", "flashinfer", 528, 0, 1),
    ("v41_nvfp4", "flashinfer", None, 208, 7),
    ("v41_nvfp4", "b12x", None, 0, 16),
    ("v41_nvfp4_inline", "flashinfer", 320, 3 * 320, 4),  # flat rows: blocks of 4 tokens padded to 7 rows
    ("v41_nvfp4_inline", "b12x", None, 0, 16),
]
POISON = (1, 3)  # NaN-filled blocks no valid index selects


def _case_inputs(kv_format, writer, row_stride, pad, page, gen, layout="nhd", scale_spread=4.0):
    """(cache, random indices of its usable blocks' tokens, -1 and out-of-range ones among
    them) of a case; the indices' divisor is the cache's (a flat-row format's: R)."""
    fmt = get_format(kv_format)
    num_blocks = 6
    block_stride = default_block_stride(fmt, page, row_stride) + pad
    cache = make_cache(num_blocks, page, device="cpu", kv_format=kv_format, writer=writer, row_stride=row_stride,
                       block_stride=block_stride, poison_blocks=POISON, layout=layout, gen=gen, spread=2,
                       scale_spread=scale_spread)
    view = read_cache_view(cache, kv_format)
    usable = [b for b in range(num_blocks) if b not in POISON]
    idx = make_indices(5, 20, view.num_slots, device="cpu", usable_blocks=usable, page=page,
                       index_page=view.index_page, invalid_frac=0.3, gen=gen)
    return cache, idx


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("kv_format,writer,row_stride,pad,page", FORMAT_CASES, ids=str)
def test_reference_matches_brute_force_every_format(kv_format, writer, row_stride, pad, page, layout):
    """-1 and out-of-range slots, lengths (0, past topk, negative), a token with nothing valid,
    sinks finite / +inf / -inf, the format's default sm_scale (d_qk ** -0.5), scales over many
    binades (and not powers of two for the FP32 writers), NaN in unselected blocks; V is the
    first 512 dims (V3.2: the nope dims, its rope only in QK)."""
    spec = SPEC[kv_format]
    seed = seed_for(f"reference {kv_format} {writer} {row_stride} {pad} {page} {layout}")
    gen = torch.Generator().manual_seed(seed)
    T, H = 5, 3
    cache, idx = _case_inputs(kv_format, writer, row_stride, pad, page, gen, layout)
    idx[2] = -1  # a token with nothing valid
    lengths = torch.tensor([20, 7, 20, 25, -3], dtype=torch.int32)  # token 4: nothing counts
    sink = torch.tensor([0.5, math.inf, -math.inf])
    q = torch.randn(T, H, spec["d_qk"], generator=gen).to(torch.bfloat16)
    out, lse = reference_decode(q, cache, idx, topk_length=lengths, attn_sink=sink, kv_format=kv_format)
    read, n = slot_reader(cache, kv_format)
    bout, blse = brute_force(q, [(read, n, idx, lengths)], spec["d_qk"] ** -0.5, D_V, sink)
    assert out.shape == (T, H, 512) and lse.shape == (T, H)
    assert_matches(out, lse, bout, blse, f"[seed {seed}] {kv_format} {writer}")
    assert torch.isposinf(lse[2]).all() and torch.isposinf(lse[4]).all() and (out[[2, 4]] == 0).all()
    assert (out[:, 1] == 0).all()  # sink +inf silences the head
    assert (out[[0, 1, 3]][:, [0, 2]] != 0).any()  # the other heads are not trivially 0


def test_v32_values_exclude_the_rope():
    """V3.2: a key's rope dims weigh in the scores and are not part of the value: a single
    entry's output is exactly its 512 nope dims."""
    gen = torch.Generator().manual_seed(seed_for("v32 value"))
    cache = make_cache(2, 4, device="cpu", kv_format="v32_fp8", gen=gen)
    read, _ = slot_reader(cache, "v32_fp8")
    q = torch.randn(1, 2, 576, generator=gen).to(torch.bfloat16)
    out, lse = reference_decode(q, cache, torch.tensor([[5]], dtype=torch.int32), kv_format="v32_fp8")
    assert torch.equal(out[0, 0], torch.tensor(read(5)[:512], dtype=torch.float64))
    k = torch.tensor(read(5), dtype=torch.float64)
    assert torch.allclose(lse[0], (q[0].double() @ k) * 576**-0.5, rtol=1e-12)
    q2 = q.clone()
    q2[..., 512:] = 0  # without the rope term the score changes
    assert not torch.allclose(reference_decode(q2, cache, torch.tensor([[5]], dtype=torch.int32),
                                               kv_format="v32_fp8")[1], lse)


@pytest.mark.parametrize("kv_format,writer", [("v32_fp8", "vllm"), ("glm_nope_fp8", "b12x"), ("model1_fp8", None)])
def test_a_single_entry_is_its_exact_dequantized_value(kv_format, writer):
    """One valid entry: out is the key's value, e4m3 x scale exactly (a float64 oracle: for
    FP32 scales that are not powers of two the product needs up to 28 significant bits)."""
    gen = torch.Generator().manual_seed(seed_for(f"single {kv_format}"))
    cache = make_cache(3, 8, device="cpu", kv_format=kv_format, writer=writer, scale_spread=6.0, gen=gen)
    read, n = slot_reader(cache, kv_format)
    q = torch.randn(2, 4, SPEC[kv_format]["d_qk"], generator=gen).to(torch.bfloat16)
    idx = torch.tensor([[11, -1, n], [0, 0, 0]], dtype=torch.int32)
    out, _ = reference_decode(q, cache, idx, kv_format=kv_format)
    assert torch.equal(out[0], torch.tensor(read(11)[:512], dtype=torch.float64).expand(4, 512))
    three = torch.tensor(read(0)[:512], dtype=torch.float64).expand(4, 512)  # duplicates of one: 3 x (1/3) v
    assert torch.allclose(out[1], three, rtol=1e-13, atol=0)  # float64 rounding of lse and the weights only


@pytest.mark.parametrize("kv_format", sorted(SPEC))
def test_masked_entries_never_read_the_cache(kv_format):
    """NaN in every block no valid index selects, block 0 (slot 0) included: -1, out-of-range
    and past-the-length entries must not reach the output, not even multiplied by 0."""
    gen = torch.Generator().manual_seed(seed_for(f"masked {kv_format}"))
    page = 4
    cache = make_cache(4, page, device="cpu", kv_format=kv_format, poison_blocks=(0, 2), gen=gen)
    q = torch.randn(3, 2, SPEC[kv_format]["d_qk"], generator=gen).to(torch.bfloat16)
    idx = torch.tensor([[5, -1, 16, 2**31 - 1, 13], [-1, -1, -1, -1, -1], [12, 4, 1, 0, 9]], dtype=torch.int32)
    lengths = torch.tensor([5, 5, 2], dtype=torch.int32)  # token 2: slots 1, 0 and 9 lie past its length
    out, lse = reference_decode(q, cache, idx, topk_length=lengths, kv_format=kv_format)
    read, n = slot_reader(cache, kv_format)
    bout, blse = brute_force(q, [(read, n, idx, lengths)], SPEC[kv_format]["d_qk"] ** -0.5, D_V)
    assert_matches(out, lse, bout, blse, kv_format)


@pytest.mark.parametrize("with_extra", [False, True])
def test_reference_matches_brute_force(with_extra):
    """MODEL1 with the extra (compressed) cache: main and extra entries in one softmax."""
    gen = torch.Generator().manual_seed(1234)
    T, H, topk = 4, 3, 20
    cache = make_cache(3, 16, device="cpu", gen=gen)
    idx = make_indices(T, topk, 48, device="cpu", invalid_frac=0.3, gen=gen)
    idx[2] = -1  # a token with nothing valid in the main list
    lengths = torch.tensor([20, 7, 0, 25], dtype=torch.int32)
    sink = torch.tensor([0.5, math.inf, -math.inf])
    q = torch.randn(T, H, 512, generator=gen).to(torch.bfloat16)
    kw = dict(topk_length=lengths, attn_sink=sink, sm_scale=0.05)
    read, n = slot_reader(cache, "model1_fp8")
    lists = [(read, n, idx, lengths)]
    if with_extra:
        extra = make_cache(5, 2, device="cpu", gen=gen)
        e_idx = make_indices(T, 6, 10, device="cpu", invalid_frac=0.2, gen=gen)
        e_len = torch.tensor([6, -3, 4, 100], dtype=torch.int32)
        kw.update(extra_kv_cache=extra, extra_indices=e_idx, extra_topk_length=e_len)
        e_read, e_n = slot_reader(extra, "model1_fp8")
        lists.append((e_read, e_n, e_idx, e_len))
    out, lse = reference_decode(q, cache, idx, **kw)
    bout, blse = brute_force(q, lists, 0.05, 512, sink)
    if not with_extra:
        assert torch.isposinf(lse[2]).all() and (out[2] == 0).all()  # empty token: lse +inf, out 0
    else:
        assert torch.isfinite(lse[2]).all()  # token 2 has extra entries
    assert_matches(out, lse, bout, blse)
    assert (out[:, 1] == 0).all()  # sink +inf silences the head


def test_duplicates_count_twice():
    gen = torch.Generator().manual_seed(7)
    cache = make_cache(2, 8, device="cpu", gen=gen)
    q = torch.randn(1, 2, 512, generator=gen).to(torch.bfloat16)
    once, lse1 = reference_decode(q, cache, torch.tensor([[3, 5]], dtype=torch.int32))
    twice, lse2 = reference_decode(q, cache, torch.tensor([[3, 3, 5]], dtype=torch.int32))
    assert not torch.allclose(once, twice)
    read, n = slot_reader(cache, "model1_fp8")
    bout, blse = brute_force(q, [(read, n, torch.tensor([[3, 3, 5]]), None)], 512**-0.5, 512)
    assert torch.allclose(twice, bout, rtol=1e-10, atol=1e-12) and torch.allclose(lse2, blse, rtol=1e-12)


# (main format, extra format, extra_kv_format passed, the extra's row stride, its padding in rows, its page)
EXTRA_CASES = [
    ("model1_fp8", "model1_nvfp4", None, None, 0, 2),  # by its own width (384)
    ("model1_nvfp4", "model1_fp8", None, None, 0, 64),
    ("model1_nvfp4", "model1_nvfp4", None, None, 0, 2),
    ("v41_fp8", "v41_fp8", None, None, 0, 2),  # 528 bytes wide: the main's own format
    ("v41_fp8", "v41_fp8_inline", "v41_fp8_inline", None, 0, 4),
    ("v41_fp8", "v41_nvfp4", "v41_nvfp4", None, 0, 4),
    ("v41_fp8", "v41_nvfp4_inline", "v41_nvfp4_inline", 288, 3, 4),  # flat rows, padded blocks
    ("v41_fp8_inline", "v41_fp8_inline", None, 544, 2, 2),
    ("v41_fp8_inline", "v41_fp8", "v41_fp8", None, 0, 8),
    ("v41_fp8_inline", "v41_nvfp4", "v41_nvfp4", None, 0, 2),
    ("v41_fp8_inline", "v41_nvfp4_inline", "v41_nvfp4_inline", None, 0, 16),
]


@pytest.mark.parametrize("main_fmt,extra_fmt,named,row_stride,pad_rows,extra_page", EXTRA_CASES, ids=str)
def test_the_extra_cache_is_read_in_its_own_format(main_fmt, extra_fmt, named, row_stride, pad_rows, extra_page):
    """Main and extra entries in one softmax, each cache read in its own format (named, the
    main's where the extra cache has the main's width, else its width's); d_v 512 for all."""
    seed = seed_for(f"extra format {main_fmt} {extra_fmt} {named} {row_stride} {pad_rows} {extra_page}")
    gen = torch.Generator().manual_seed(seed)
    T, H = 4, 3
    main = make_cache(3, 16, device="cpu", kv_format=main_fmt, gen=gen, spread=2)
    fmt = get_format(extra_fmt)
    pitch = row_stride or (fmt.row_pitches[0] if fmt.inline else None)
    block_stride = default_block_stride(fmt, extra_page, pitch) + pad_rows * (pitch or 0)
    extra = make_cache(5, extra_page, device="cpu", kv_format=extra_fmt, row_stride=row_stride,
                       block_stride=block_stride, gen=gen, spread=2)
    view = read_cache_view(extra, extra_fmt)
    idx = make_indices(T, 20, 48, device="cpu", invalid_frac=0.2, gen=gen)
    e_idx = make_indices(T, 9, view.num_slots, device="cpu", usable_blocks=range(5), page=extra_page,
                         index_page=view.index_page, invalid_frac=0.2, gen=gen)
    e_len = torch.tensor([9, -3, 4, 100], dtype=torch.int32)
    sink = torch.tensor([0.5, math.inf, -math.inf])
    q = torch.randn(T, H, 512, generator=gen).to(torch.bfloat16)
    out, lse = reference_decode(q, main, idx, attn_sink=sink, extra_kv_cache=extra, extra_indices=e_idx,
                                extra_topk_length=e_len, kv_format=main_fmt, extra_kv_format=named)
    read, n = slot_reader(main, main_fmt)
    e_read, e_n = slot_reader(extra, extra_fmt)
    assert e_n == view.num_slots
    bout, blse = brute_force(q, [(read, n, idx, None), (e_read, e_n, e_idx, e_len)], 512**-0.5, D_V, sink)
    assert out.shape == (T, H, D_V)
    assert_matches(out, lse, bout, blse, f"[seed {seed}] {main_fmt} + {extra_fmt}")
    only_main, _ = reference_decode(q, main, idx, attn_sink=sink, kv_format=main_fmt)
    assert not torch.allclose(out, only_main), f"[seed {seed}]: the extra entries must count"


def test_an_extra_cache_of_ambiguous_width_is_the_mains_placement():
    """A 288-byte-wide extra cache next to a V4.1 FP8 main cache is footer or inline NVFP4 by its
    width: the main's scale placement decides (footer beside footer), as naming it does."""
    gen = torch.Generator().manual_seed(seed_for("extra ambiguous"))
    main = make_cache(2, 8, device="cpu", kv_format="v41_fp8", gen=gen)
    extra = make_cache(2, 4, device="cpu", kv_format="v41_nvfp4", gen=gen)
    q = torch.randn(1, 2, 512, generator=gen).to(torch.bfloat16)
    idx = torch.tensor([[0, 3]], dtype=torch.int32)
    e_idx = torch.tensor([[1, 5]], dtype=torch.int32)
    out, _ = reference_decode(q, main, idx, extra_kv_cache=extra, extra_indices=e_idx, kv_format="v41_fp8",
                              extra_kv_format="v41_nvfp4")
    unnamed, _ = reference_decode(q, main, idx, extra_kv_cache=extra, extra_indices=e_idx, kv_format="v41_fp8")
    assert torch.equal(out, unnamed)
    read, n = slot_reader(main, "v41_fp8")
    e_read, e_n = slot_reader(extra, "v41_nvfp4")
    bout, _ = brute_force(q, [(read, n, idx, None), (e_read, e_n, e_idx, None)], 512**-0.5, D_V)
    assert torch.allclose(out, bout, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kv_format", ["v41_fp8_inline", "v41_nvfp4_inline"])
def test_flat_row_indices_read_a_padded_blocks_rows(kv_format):
    """A flat-row cache of blocks of P = 3 tokens padded to R = 5 rows: index r is row r of the
    whole cache, so the indices P..R-1 of a block name its padding rows and read the bytes
    there (here valid records, as the reference and the brute force both find); index
    (num_blocks - 1) * R + P is past the last token and not valid. ``make_cache``'s padding
    rows (0xFF) read as NaN."""
    seed = seed_for(f"flat rows reference {kv_format}")
    gen = torch.Generator().manual_seed(seed)
    fmt = get_format(kv_format)
    pitch, page, rows = fmt.row_pitches[0], 3, 5
    full = pack_latent(torch.randn(4, rows, 512, generator=gen), kv_format)  # every row a record
    cache = torch.as_strided(full, (4, page, 1, pitch), (rows * pitch, pitch, pitch, 1))
    idx = torch.tensor([[3, 4, 8, 9, 15, 18], [18, -1, 17, 13, 0, 19]], dtype=torch.int32)
    q = torch.randn(2, 2, 512, generator=gen).to(torch.bfloat16)
    out, lse = reference_decode(q, cache, idx, kv_format=kv_format)
    read, n = slot_reader(cache, kv_format)
    assert n == 3 * rows + page == 18
    bout, blse = brute_force(q, [(read, n, idx, None)], 512**-0.5, D_V)
    assert_matches(out, lse, bout, blse, f"[seed {seed}]")
    assert torch.allclose(reference_decode(q, cache, idx[:, :1], kv_format=kv_format)[0][0],
                          torch.tensor(read(3), dtype=torch.float64).expand(2, 512), rtol=1e-13, atol=0)
    poisoned = make_cache(4, page, device="cpu", kv_format=kv_format, block_stride=rows * pitch, gen=gen)
    out, _ = reference_decode(q, poisoned, torch.tensor([[0, 4], [0, 2]], dtype=torch.int32), kv_format=kv_format)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()
