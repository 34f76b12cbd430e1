"""The float64 reference against an independent brute-force loop (CPU), every cache format.

The brute force reads each selected slot's bytes itself (the byte layout of each format, from
its specification; e4m3, UE8M0, FP32 and bf16 decoded in plain Python, exact in float64), then
loops over tokens, heads and entries. It shares nothing with ``cache_format`` or the reference.
"""

import math
import struct

import pytest
import torch

from cute_kernels.sparse_mla_decode.reference import reference_decode
from dispatch.testing import make_cache, make_indices
from tests.fp_spec import e4m3_value
from tests.tolerances import seed_for

# the byte layout of each format (its specification, written out here):
# d_qk, nope dims, scale group, scale placement, FP32 scales?, rope offset in the row, d_v
SPEC = {
    "model1_fp8": dict(d_qk=512, nope=448, group=64, footer=True, fp32=False, rope_at=448, row=576, d_v=512),
    "v32_fp8": dict(d_qk=576, nope=512, group=128, footer=False, fp32=True, rope_at=528, row=656, d_v=512),
    "glm_nope_fp8": dict(d_qk=512, nope=512, group=128, footer=False, fp32=True, rope_at=528, row=528, d_v=512),
}


def slot_reader(cache: torch.Tensor, kv_format: str):
    """A function slot -> the dequantized latent (list of d_qk Python floats, exact) of an NHD
    or HND view ``cache`` of ``kv_format`` (page, block and row strides from its strides)."""
    spec = SPEC[kv_format]
    raw = bytes(cache.untyped_storage().cpu())
    base = cache.storage_offset()
    nb = cache.shape[0]
    page = cache.shape[1] if cache.shape[2] == 1 else cache.shape[2]
    block_stride = cache.stride(0)
    row_stride = cache.stride(1) if cache.shape[2] == 1 else cache.stride(2)
    if page == 1:
        row_stride = 0

    def read(slot: int) -> list:
        assert 0 <= slot < nb * page
        block = base + (slot // page) * block_stride
        t = slot % page
        if spec["footer"]:
            row = block + t * spec["row"]
            scales = [2.0 ** (raw[block + page * spec["row"] + 8 * t + g] - 127) for g in range(spec["nope"] // 64)]
        else:
            row = block + t * row_stride
            scales = list(struct.unpack("<4f", raw[row + 512:row + 528]))
        nope = [e4m3_value(raw[row + i]) * scales[i // spec["group"]] for i in range(spec["nope"])]
        rope_n = spec["d_qk"] - spec["nope"]
        rope = [struct.unpack("<f", b"\0\0" + raw[row + spec["rope_at"] + 2 * r:row + spec["rope_at"] + 2 * r + 2])[0]
                for r in range(rope_n)]
        return nope + rope

    return read, nb * page


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
    ("v32_fp8", "flashmla", None, 0, 16),  # power-of-two FP32 scales
    ("v32_fp8", "vllm", 672, 48, 7),  # max(amax / 448, FLT_MIN): not powers of two; padded rows, page gaps
    ("v32_fp8", "sglang", 656, 0, 1),
    ("glm_nope_fp8", "vllm", 528, 0, 16),
    ("glm_nope_fp8", "b12x", 656, 160, 3),  # 528-byte rows in 656-byte pool rows
]
POISON = (1, 3)  # NaN-filled blocks no valid index selects


def _case_inputs(kv_format, writer, row_stride, pad, page, gen, layout="nhd", scale_spread=4.0):
    from cute_kernels.sparse_mla_decode.cache_format import default_block_stride
    from cute_kernels.sparse_mla_decode.kv_format import get_format

    fmt = get_format(kv_format)
    num_blocks = 6
    block_stride = default_block_stride(fmt, page, row_stride) + pad
    cache = make_cache(num_blocks, page, device="cpu", kv_format=kv_format, writer=writer, row_stride=row_stride,
                       block_stride=block_stride, poison_blocks=POISON, layout=layout, gen=gen, spread=2,
                       scale_spread=scale_spread)
    usable = [b for b in range(num_blocks) if b not in POISON]
    return cache, usable, num_blocks * page


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("kv_format,writer,row_stride,pad,page", FORMAT_CASES, ids=str)
def test_reference_matches_brute_force_every_format(kv_format, writer, row_stride, pad, page, layout):
    """-1 and out-of-range slots, lengths (0, past topk, negative), a token with nothing valid,
    sinks finite / +inf / -inf, the format's default sm_scale (d_qk ** -0.5), scales over many
    binades (and not powers of two for the FP32 writers), NaN in unselected blocks; V is the
    first 512 dims (V3.2: the nope dims, its rope only in QK)."""
    spec = SPEC[kv_format]
    gen = torch.Generator().manual_seed(seed_for(f"reference {kv_format} {writer} {row_stride} {pad} {page} {layout}"))
    T, H, topk = 5, 3, 20
    cache, usable, num_slots = _case_inputs(kv_format, writer, row_stride, pad, page, gen, layout)
    idx = make_indices(T, topk, num_slots, device="cpu", usable_blocks=usable, page=page, invalid_frac=0.3, gen=gen)
    idx[2] = -1  # a token with nothing valid
    lengths = torch.tensor([20, 7, 20, 25, -3], dtype=torch.int32)  # token 4: nothing counts
    sink = torch.tensor([0.5, math.inf, -math.inf])
    q = torch.randn(T, H, spec["d_qk"], generator=gen).to(torch.bfloat16)
    out, lse = reference_decode(q, cache, idx, topk_length=lengths, attn_sink=sink, kv_format=kv_format)
    read, n = slot_reader(cache, kv_format)
    bout, blse = brute_force(q, [(read, n, idx, lengths)], spec["d_qk"] ** -0.5, spec["d_v"], sink)
    assert out.shape == (T, H, 512) and lse.shape == (T, H)
    assert_matches(out, lse, bout, blse, f"{kv_format} {writer}")
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
    bout, blse = brute_force(q, [(read, n, idx, lengths)], SPEC[kv_format]["d_qk"] ** -0.5, 512)
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
