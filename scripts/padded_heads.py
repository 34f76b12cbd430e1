"""GPU time of the vLLM call with zero-padded query heads: served as given, told which are
padding (``num_valid_heads``), and without padding.

    python -m scripts.padded_heads

vLLM pads DeepSeek-V4's query heads to 8/16/32/64/128 before FlashInfer's call; the adapter
(``dispatch.engines.flashinfer_dsv4.trtllm_batch_decode_sparse_mla_dsv4``) serves every head it is given
unless the caller says how many are real. For head counts that vLLM pads (4 -> 8 at TP16 of
a 64-head model, 24 -> 32, 48 -> 64), T {1, 8, 64} and the SWA window (128) plus a ratio-4
layer's 512 extra entries, this times each way by the method of ``scripts.bench`` (one call
captured in a CUDA graph, median of ``triton.testing.do_bench``) and prints the padded
call's time over the unpadded one's.
"""

from __future__ import annotations

import sys

import torch

from cute_kernels.sparse_mla_decode.kv_format import DEFAULT_FORMAT, get_format
from dispatch.engines.flashinfer_dsv4 import trtllm_batch_decode_sparse_mla_dsv4
from dispatch.tools.sample_inputs import make_cache, make_indices
from scripts.bench import graph_time_us

FORMAT = get_format(DEFAULT_FORMAT)
PADDED = {4: 8, 24: 32, 48: 64}  # vLLM's _pad_to_supported_q_heads


def main(argv=None) -> int:
    gen = torch.Generator().manual_seed(0)
    swa = make_cache(512, 64, device="cuda", gen=gen)
    compressed = make_cache(512, 64, device="cuda", gen=gen)
    print(f"{'T':>4} {'heads':>5} {'padded':>6} | {'us served':>9} {'us valid':>9} {'us unpadded':>11} | "
          f"{'served/unpadded':>15} {'valid/unpadded':>14}")
    for T in (1, 8, 64):
        idx = make_indices(T, 128, 512 * 64, device="cuda", gen=gen)
        extra = make_indices(T, 512, 512 * 64, device="cuda", gen=gen).view(T, 1, 512)
        for heads, padded in PADDED.items():
            q = torch.zeros(T, padded, FORMAT.d_qk, dtype=torch.bfloat16, device="cuda")
            q[:, :heads] = torch.randn(T, heads, FORMAT.d_qk, generator=gen).bfloat16().cuda()
            out = torch.empty(T, padded, FORMAT.d_v, dtype=torch.bfloat16, device="cuda")
            base = dict(swa_kv_cache=swa, workspace_buffer=None, sparse_indices=idx, compressed_kv_cache=compressed,
                        extra_sparse_indices=extra, bmm1_scale=FORMAT.default_sm_scale, kv_layout="NHD")
            served = graph_time_us(lambda: trtllm_batch_decode_sparse_mla_dsv4(query=q, out=out, **base))
            valid = graph_time_us(lambda: trtllm_batch_decode_sparse_mla_dsv4(query=q, out=out, **base,
                                                                               num_valid_heads=heads))
            q_real, out_real = q[:, :heads].contiguous(), out[:, :heads].contiguous()
            unpadded = graph_time_us(lambda: trtllm_batch_decode_sparse_mla_dsv4(query=q_real, out=out_real, **base))
            print(f"{T:>4} {heads:>5} {padded:>6} | {served:>9.1f} {valid:>9.1f} {unpadded:>11.1f} | "
                  f"{served / unpadded:>15.2f} {valid / unpadded:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
