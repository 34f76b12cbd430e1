"""Split-K partial kernel, "f16" form (``PartialConfig.precision == "f16"``): column-sliced
warps, e4m3 -> f16 in registers, the softmax spread over the CTA.

Same work split, rows ``num_stages - 1`` chunks ahead (``partial.py``, ``_next_chunk``) and
outputs as the bf16 kernel; the indices ``num_stages`` ahead or, except in the one-group kernel
at the register bound, one chunk further (``late_indices``); the gather is one warp's (below)
and the compute differs. The CTA covers 16 or 32 heads (``head_groups`` m16 tiles: two for
many heads, ``dispatch.variants.head_groups_for``: on sm_120, where an SM holds one CTA, from
64 16-head blocks with 512 entries; on the H200, two 32-head CTAs per SM held to 128 registers
as the 16-head ones are, where their grid fills three quarters of those slots or their
splits leave each enough chunks) with 8 warps,
and warp w owns 64 columns of the QK width and of the output FOR EVERY HEAD of the CTA: nope
tile w (w < 7, one UE8M0 scale per entry) or the 64 rope dims (w = 7). So each gathered byte
is turned into an MMA operand by exactly one warp, once for QK and once for PV, and a 32-head
CTA multiplies each operand register into two m16 tiles. There is no dequantized tile in shared memory.

Per CTA (once): Q's nope dims of head h are scaled by 2**(14 - E_h), E_h the exponent of the
head's largest |q| (so |q| < 2**15 fits f16 exactly: f16 has more mantissa than bf16) and
held in registers as f16 A fragments; the rope warp keeps Q's rope dims as bf16.

Per chunk of 32 entries:
1. QK, warp w < 7: per 8-entry n tile one ``ldmatrix.x4`` of the raw rows (lane 8i + r: row
   r, bytes 16i..16i+15 of the tile) gives each thread bytes 4q..4q+3 of each 16-column
   group; ``cvt.rn.f16x2.e4m3x2`` turns them into the f16 B fragment of k order {2q, 2q+1,
   8+2q, 9+2q} (Q's A fragments are loaded in the same column order), 4 f16 MMAs per m16
   tile, then times the entry's 2**(b - 127). Warp 7: bf16 MMAs on the raw bf16 rope bytes.
   The nope warps take the n tiles two or four at a time (``QK_TILES_AT_ONCE``) so that
   chains of 4 dependent MMAs interleave, the rope warp all four (``ROPE_QK_TILES_AT_ONCE``).
   Each warp writes its partial S [heads, 32] (f32) to shared memory.
2. Softmax, all 256 threads: thread t sums the 8 partials of 2 or 4 consecutive entries of
   one head (nope sum times 2**(E_h - 14), plus rope, times sm_scale log2(e)), masks invalid
   entries to -inf, and runs the online softmax with the 16 or 8 threads of its head (the
   row sum stays per thread until the end). A head's reference max moves only when the
   chunk's max exceeds it by more than ``RESCALE_LOG2`` (so P <= 2**8). After the first
   chunk each thread writes P (f16 and bf16) against the old max and only tests its own
   entries against it; the barrier after it (``barrier.red.or``) tells every thread whether
   any head's max moved, and only then (rarely; always in the first chunk) the exact step
   runs: the head's max by shuffles, P and the rescale factor again, one more barrier.
3. PV, warp w < 7: P' = P * 2**(b - R_w) (f16, ``mul.rn.f16x2`` on the ``ldmatrix``-loaded
   P fragments), R_w the running maximum of tile w's scale byte over the valid entries of
   the split so far, so P' <= 1; the value fragments are the raw rows by
   ``ldmatrix.x4.trans`` (rows 2q, 2q+1 of each 8-entry group, two adjacent columns) with one
   byte permute into (row 2q, row 2q+1) pairs per column: even and odd columns of each
   16-column group are two MMAs, and each thread ends with 4 adjacent output columns. The
   accumulator is in units of 2**(R_w - 127). The accumulators are rescaled (a loop of 0 or 1
   pass) only when a head's max or R_w moved. Warp 7: P in bf16 times the raw bf16 rope rows.
Gather: in the main loop the rope warp alone issues the next chunks' indices, validity
masks, rows and scales (``_locate_rows`` / ``_copy_rows``; invalid rows zero-filled by the
copies' src-size 0): the first ``EARLY_ROW_GROUPS`` of its 4 groups of 8 rows after the
chunk-head barrier, the rest after the softmax, to even out its phases against the nope
warps'; a later chunk's indices right after that barrier, or (``late_indices``: the kernel
without the register bound) with the late rows. The first two chunks' rows, on every call's
critical path, are copied by all 256 threads (``_issue_rows``; each waits for its own copies
before the barrier that publishes them).
Invalid entries have zero rows and probability 0. Three CTA barriers per chunk (four when a
max moved): the stage landed (and the previous PV is done), the partial S written, P written.

Precision: K, V and the scales are exact (every e4m3 value is an f16 value; the scales are
applied in f32 to S and as powers of two to P); Q is exact unless a component is below
2**-24 of its head's largest (f16 subnormal); P is rounded to f16 (11 bits; bf16: 8). Limit:
an entry whose scale byte in a tile is more than 24 below the largest of that tile among the
split's valid entries has P' below f16's smallest subnormal and counts as 0 in that tile's
output columns (a value scale 2**24 times smaller than its neighbours'; DSV4's per-token
scales of normalized latents span a few binades).

The two roles run in two separate code paths (one branch on the warp index, around the whole
loop): a per-chunk branch would have ptxas predicate both sides into every warp's stream
(seen on the FP8 path).

Measured facts (H200, sm_90a build of this source, 2026-12-01; BENCHMARKS.md has the runs):
- Against the bf16 kernel (partial.py): faster on all 48 bench shapes (first f16 version:
  1.05-1.2x at 1 token, 1.8-1.9x at 64-256 tokens).
- Session 6 (the same day), each step timed with ``scripts/bench.py``: (1) the gather moved
  from all 256 threads to the rope warp, and the lazy rescale: 64 x 128 x 1024 141 -> 125 us,
  64 x 64 x 1024 73.6 -> 65.8; (2) the rope warp's row copies split around its QK / PV phases
  (``EARLY_ROW_GROUPS``) with a third row stage for 16 heads: 8 x 128 x 1024 27.3 -> 25.7 us;
  with only two stages the late copies cost 4-13% at 64 tokens (too little time to land);
  (3) then 16-head CTAs beat 32-head ones almost everywhere (``head_groups_for``): 64 x 128 x
  1024 117.8 us. Tried and not kept: both rescale paths with their own copy of the PV MMAs
  (avoids ~60 register moves with 32 heads; 3-5% slower: the isolated MMA block is padded
  with NOPs). Early row groups 1 and 2 alike within noise (1 kept); 0 (all copies after the
  softmax) 8% slower at 8 x 128 x 1024. The next chunk's index copy moved from the early to
  the late part (the rope warp's QK phase then even with the nope warps' in the SASS): T=1
  0.1-0.3 us faster, 64-256 tokens 2-4% slower in one run (a new lease): not kept.
- Session 7 (the same day, same method, each against the tree before it in the same lease):
  (1) the first two chunks' rows copied by all 256 threads instead of the rope warp alone
  (its ~150 instructions of copies were between the indices landing and the first rows
  leaving): 8 and 64 tokens 1-3% faster, T=1 within noise (+-0.3 us); an earlier form with
  the nope warps' wait in a branch at every chunk head was 0.5-1% slower at 64 tokens, and a
  form without their wait was faster still but raced (caught by the suite's two-run check);
  (2) QK's n tiles two at a time: one tile at a time, the SASS had each warp's 16 QK MMAs
  back to back on one accumulator register set (12 of them waiting on the MMA just before:
  ``sass_check.LoopMix.chained_mma``), now two chains of 4 interleave (0 waiting), the
  same instruction count: 64 x 128 x 1024 117.1 -> 111.9 us, 64 x 64 x 1024 62.0 -> 59.4,
  8 x 128 x 1024 25.5 -> 24.9, T=1 unchanged. Four tiles at once: 40 more instructions per
  chunk at the 128-register bound (not measured). Tried and not kept: (a) a software-pipelined
  loop (chunk c's PV in one block with chunk c + 1's QK, two barriers per chunk instead of
  three): 164 registers; held to 128 it spills, 5-14% slower; unbounded (one CTA per SM on the
  H200) 0-9% slower than this kernel at one CTA per SM; ~40 more register moves per chunk where
  the rescale loop joins; (b) the rope warp locating chunk c + 3 in chunk c's PV phase (its QK
  phase 192 -> 135 instructions, indices 4 chunks ahead): 3-7.5% slower at 64 tokens x 64 /
  128 heads (the indices then have one chunk to land).
- Session 8 (the same day, same method). (1) At sm_120's occupancy (one CTA per SM: the
  H200 with this kernel's shared memory padded past half the SM's, ``scripts/bench.py
  --tokens 8,64,256 --no-torch``, against ``--head-groups 2``, one lease) 32-head CTAs were
  1.27-1.39x faster than 16-head ones at 64 and 256 tokens x 64/128 heads (64 x 128 x 1024:
  158.1 -> 115.9 us), 1.03-1.12x at 8 x 128 with 512+ entries, 0.91-1.01x at 8 x 64 and
  8 x 128 x 128, 0.74-1.0x at 16 heads: the dispatch's choice on sm_120 (``head_groups_for``).
  On the H200 itself two 16-head CTAs per SM stay: held to one per SM they were 1.24-1.41x
  slower at 64 tokens x 64/128 heads and 0.95-1.13x at 8 tokens (two leases of the day).
  Tried and not kept: (a) the rope dims' QK moved from the rope warp to nope warps 0..3 (one
  n tile each, Q's rope fragments by ``ldmatrix`` from shared memory): ncu at 64 x 128 x 1024
  had the nope warps waiting at the barrier after QK for the rope warp (13% of all warp
  samples; its QK phase 188 instructions against their 146); the move made it 124 against
  161 (the nope warps at the 128-register bound: 15 more moves) and measured up to 5% slower
  on 35 of 36 shapes (64 x 128 x 1024 111.9 -> 115.3 us; with two early row groups 116.2);
  (b) the merge fused into a cluster: a row's 2..8 splits launched as one thread-block
  cluster, each CTA leaving its normalized partial output and lse in shared memory and
  combining a share of the row from its peers' through distributed shared memory (one
  launch, no scratch; correct on the GPU suite plus cases forced to every cluster size): at
  T=1 not faster (1 x 16 x 128 10.05 -> 11.0 us, 1 x 128 x 1024 12.86 -> 13.28 / 12.86), and
  where two CTAs per SM were planned up to 1.5x slower (8 x 128 x 1024 24.9 -> 37.0 us: the
  clustered grid did not run in one wave; with two splits 29.0).
- Session 9 (the same day, same method, one lease, two rounds each): instruction cuts, each
  an exact rewrite (the same values by construction; the GPU suite passes unchanged): no
  identity ``prmt`` before each QK conversion (ptxas keeps one of inline PTX: 15
  instructions per nope warp and chunk), the QK scales as an integer max (``warp_ops.ue8m0_scale``: 2**-127 for byte 0 below
  every other, no test and select) and P''s factors as one multiply-add and a max per byte,
  and the page division by a host multiplier (``cache_format.page_division_magic``: the rope
  warp's QK phase 188 -> 178). 64 tokens x 64/128 heads 2.5-3.1% faster (64 x 128 x 1024
  112.6 -> 109.7 us), 1 and 8 tokens within noise or up to 4% faster, none slower beyond 1%.
  Then (next lease) the rope warp's QK with all 4 n tiles at once (``ROPE_QK_TILES_AT_ONCE``:
  its QK phase, the chunk's longest, 178 -> 166 instructions, no NOPs between its dependent
  MMAs; 7 more in its other phases): 1 token x 64/128 heads with 512+ entries 2.6-3.4%
  faster (1 x 128 x 1024 13.0 -> 12.6 us), the 36 shapes 0.991x in geometric mean, none
  slower beyond 1% but two T=1 shapes within the lease's noise (+2.4%, +3.1%). Tried and not
  kept: the next chunk's indices issued by nope warp 0 instead of the rope warp (its QK phase
  then 149; the nope warps' loop 18 instructions longer by the register allocation): 0.993x
  alone, 0.990x with the rope change, no better than the rope change alone.
  Tried on the sm_120a SASS only (not run): a 16-warp 32-head CTA, two warps per 64-column
  unit (QK split by n tiles, PV by columns, two rope warps sharing the gather, 128 registers,
  87 KB): 14 x 363 + 2 x 365 = 5812 warp-instructions per chunk for 32 heads against
  2 x 2873 for two 16-head CTAs. The conversions halve, but each warp keeps its own fixed
  costs (the softmax, the scales), and at the 128-register bound ptxas adds ~30 moves in PV.
- Session 10 (the same day, one lease, two rounds): the 128-register launch bound only where
  the grid puts two CTAs on an SM (``PartialConfig.two_ctas_per_sm``); with one CTA per SM
  ptxas takes 136 registers and the sm_120a loops shorten (below): every 1- and 8-token shape
  that runs one CTA per SM 1-3.4% faster (1 x 128 x 1024 12.80 -> 12.45 us, 1 x 128 x 128+512
  12.13 -> 11.84), 64 x 16 x 128 and 8 x 64 x 128 unchanged; held to one CTA per SM where the
  grid needs two, 13-33% slower (which is why the bound stays there). Tried and not kept: a
  9th warp that only gathers, for the kernel without the bound (the rope warp's loop 348 ->
  228 instructions, the longest phases per chunk summed 354 -> 327, but the nope warps' loop
  319 -> 329 by 19 register moves where the rescale loop joins): correct, and 0.98-1.05x on
  the H200 at one CTA per SM, mostly slower (1 x 128 x 1024 12.67 -> 13.18 us); with two head
  groups 9 warps put 3 on one scheduler, whose 16K registers cap each thread at 168 (the
  32-head kernel needs 202: it spilled). Four QK n tiles at once without the bound: PV 136 ->
  149 instructions (SASS only).
- Session 11 (the same day, one lease, two rounds): the softmax after the first chunk against
  the old reference max (each thread tests its own entries; the P barrier ORs the tests; the
  exact step, with the row max by shuffles, P again and one more barrier, only when a test is
  set, and always in the first chunk): every value the same as before; 0.990x geomean over
  the 36 shapes, 64 tokens x 64 / 128 heads 2.0-2.8% faster (64 x 128 x 1024 108.4 -> 106.2
  us), T=1 x 64 / 128 heads 1.6-2.5% (1 x 128 x 1024 12.80 -> 12.51). Not kept (SASS): the
  exact step as a 0-or-1-pass loop (154 registers, 77 register moves in the rope warp's
  loop), its condition by ``vote.sync.any`` (68+ moves per loop), none of the two (ptxas's
  divergent-warp fallback for the shuffles), and skipping the first chunk's rescale (69
  moves where the rescale loop joins). Then (next lease) QK's four n tiles at once in the
  one-group kernel without the bound (``QK_TILES_AT_ONCE``): T=1 11 of 12 shapes 0.6-4%
  faster (1 x 128 x 1024 12.74 -> 12.48 us), 8 x 16 x all 0.7-4% (8 x 16 x 128 10.78 ->
  10.34), 64 x 16 x 128 12.54 -> 12.32, 8 x 128 x 128 (four chunks per CTA) 11.62 -> 11.90.
- Session 12 (2026-12-02): ncu's per-instruction warp samples at 64 x 128 x 1024 (all 16 warps
  of an SM): 19.5% of them at barriers, 8.6% the nope warps at the chunk-head barrier and 7.9%
  at the one after QK (waiting for the rope warp's QK phase, gather included), 1.8% at the P
  barrier; the rope warp's cp.async wait before the chunk-head barrier 0.04%: the rows land in
  time, the rope warp's instructions are what the others wait for. Hence the later indices
  (``late_indices``) where its PV phase has room: the kernel without the bound 0.991x /
  0.994x over its 21 bench shapes in two leases; at the bound up to 1.7% slower (14 of 15
  shapes), not used there.
- Session 13 (2026-12-02, ``scripts/bench.py`` A/B, old / new / old / new in one lease, each
  shape's minimum): the H200's ``mma.sync`` f16 rate is 618 TFLOP/s
  (``scripts/mma_ceiling.py``): 64 x 128 x 1024 runs at 161 TFLOP/s (26% of it; FlashMLA's wgmma
  336, 54%); at ~10 instructions per MMA (2580 per 256 MMAs per chunk) even full issue (4 per
  clock and SM, 1.98 GHz) would cap it at ~69%. Tried and not kept ((a) and (b) passed the GPU
  suite): (a) PV's value fragments as ``movmatrix`` transposes of QK's converted B fragments (no
  ``ldmatrix.trans``, byte permute or second conversion): the nope loop without the bound 320 ->
  300 sm_90a instructions, 352 -> 360 sm_120a (ptxas moves the accumulators around the MOVMs),
  and 1.087x slower on the 36 FlashMLA shapes (64 x 128 x 1024 106.1 -> 114.7 us): MOVM is
  expensive on the H200; (b) the list parameters of a chunk (index row, lengths, page, magic,
  stride, base of the main or the extra list) from a table in shared memory instead of ptxas's
  per-chunk constant loads and selects: the rope warp's QK phase at the bound 168 -> 137-150
  sm_90a instructions, and 1.005x slower in both placements tried (LDS latency on its critical
  chain); (c) four QK n tiles at once at the register bound: 1.003x (64 x 64 / 128 up to 1.5%
  slower); (d) two early row groups: 1.015x slower. SASS only: the nope warps copying their own
  64 columns of the late row groups from row addresses the rope warp publishes (rope loop 371 ->
  333 sm_90a instructions) costs each nope warp ~45 (addresses, masks, stage arithmetic per
  lane): at the bound the nope warps' PV interval 115 -> 168 sm_90a instructions against the
  rope warp's QK interval 168 -> 171: not run. And 32-head CTAs at 1 and 8 tokens
  (``--head-groups 2``, 64 / 128 heads) again 1.0-1.27x slower than 16-head ones on the H200.
- Session 14 (2026-12-02, same method; none kept, BENCHMARKS.md has the tables): (a) the
  warps' roles rotated by two where the CTA's first hardware warp slot (``%warpid``) lies in an
  odd block of 8, so that two CTAs on an SM keep their rope warps on different sub-partitions:
  1.006x over 24 shapes; (b) "entry halves", 16 warps, two per 64-column unit, each taking 16
  of a chunk's entries (113 registers, 304 / 365 instructions per warp and chunk): correct, and
  8-16% slower on each of the 21 shapes that run one CTA per SM (1 x 128 x 1024 12.61 -> 13.98
  us): the shorter per-warp chains did not shorten the call; (c) a dequantized f16 tile shared by
  32 heads in 16 warps (QK by column pairs, PV from the tile, four CTA barriers per chunk, 95.9
  KB): correct, and 1.29-1.37x slower at 64 / 256 tokens x 64 / 128 heads (64 x 128 x 1024
  106.3 -> 140.0 us); (d) SASS only: a ``cp.async.bulk`` per gathered row takes uniform
  operands, so one per lane becomes a 32-pass loop over the lanes: no fewer instructions.
- Session 15 (2026-12-02, same method, one lease): the 32-head kernel held to 128 registers, two
  CTAs per SM like the 16-head one (87 KB of shared memory each; sm_90a: 128 registers, loops
  577 / 633 instructions with 15 / 28 spill loads and stores, against 2 x (7 x 358 + 406) =
  5824 per 32 heads and chunk for two 16-head CTAs: 7 x 577 + 633 = 4672). Where its grid
  needs no split and fills the slots: 64 x 128 x all 0.835-0.881x the time (64 x 128 x 1024
  106.4 -> 88.8 us), 256 x 64 / 128 x all 0.824-0.858x, 128 x 64 x 512 0.861x, 256 x 32 x 1024
  0.852x. Where it needs a split the 16-head CTAs do not, or leaves a quarter of the slots
  idle, slower: 64 x 64 x 512 1.144x, 32 x 128 x 512 1.135x, 128 x 32 x 512 1.155x, 8 x 128 x
  1024 1.085x, 48 x 128 x 512 and 96 x 64 x 512 (192 CTAs on 264 slots) 1.010x / 1.015x; with
  splits on both sides 16 x 128 x 1024 0.970x, 32 x 64 x 1024 0.977x. Hence the H200 rule in
  ``dispatch.variants.head_groups_for``. Then the rope warp's QK two n tiles at a time there
  (``ROPE_QK_TILES_AT_ONCE``; loops 576 / 590, 34 spill instructions, 15 / 1 of them in the
  loops, 4622 per 32 heads and chunk): 64 x 128 x all another 0.981-0.993x.
- Main loop per chunk and thread, sm_120a SASS, 16 heads, split mode, a chunk without the
  rescale pass and the exact softmax step (32-40 more instructions when a max moved): held
  to 128 registers, nope warps 319 instructions, rope warp 367; without the bound (136
  registers, sm_120's kernel, QK's four n tiles at once): 320 and 340 (the QK phases 120 and
  116, the softmax 47 each, PV 143 + 2 and 139 + 29 with the later indices); 32 heads (204
  registers): 459 and 460.
  2580 warp-instructions per chunk (2600 at the bound) against 4194 before session 6 (bf16
  kernel: 4690). The nope warps' 32 HMMA are
  10% of their instructions: the loop is latency-bound (ncu at 64 x 128 x 1024, session 11:
  issue slots 45% busy, 8.4 cycles between a warp's issues with 3.8 warps per scheduler, of
  them fixed-latency waits 1.9, the barriers 1.6, shared memory / shuffles 1.4).
- A single CTA alone on an SM takes about 1.4 us per chunk (``scripts/split_sweep.py``, one
  split of 1 x 64 x 1024): the floor of the small calls, with the two kernel launches. At
  T=1 the fixed part dominates (session 7): a CUDA graph of one trivial kernel measures 4.6
  us by the bench's method; ncu's warp samples of 1 x 128 x 1024 (two chunks per CTA) fall
  about half before the main loop (kernel-parameter loads, the wait for Q and the indices,
  the first rows' issue), 38% in the nope loop.
- Tracing notes (CuTe DSL 4.8.1): a dict or namespace of DSL values passed into a helper with
  a dynamic branch has its entries rebound to the branch's results, which then escape their
  region (IR that does not verify): read such attributes into locals before a branch, and
  give each role its own copies (``_role_start``). A Uint8 shared-memory load widens with a
  sign extension (``device_utils.load_smem_u8`` masks it).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, const_expr
from cutlass.memory import SmemAllocator

from .config import F16_P_ROW_BYTES, F16_S_ROW, F16_WARPS, RAW_ROW_STRIDE
from .device_utils import cp_async_zfill, load_smem_u8, smem_vec as _smem_vec
from .layout import D_NOPE, D_QK, NUM_TILES, ROW_BYTES, SCALE_BYTES
from .partial import SparseMlaPartialKernel
from .warp_ops import (
    e4m3x4_to_f16x2, f32_from_bits, ldsm_x4, mma_bf16, mma_f16, mul_f16x2, pack_bf16x2, pack_f16x2,
    pow2_f32, pow2_f32_bits, sync_threads_or, ue8m0_scale, warp_max_u32,
)

UNIT = 64  # columns per warp: one nope scale tile, or the rope dims
ROPE_WARP = NUM_TILES  # warp 7
Q_F16_EXP = 14  # Q's nope dims times 2**(14 - E): the head's largest lands in [2**14, 2**15)
ROPE_BYTE0 = D_NOPE  # the rope dims' first byte in a row (bf16 from there)
# prmt selector turning ldmatrix.trans bytes (row 2q: c, c+1; row 2q+1: c, c+1) into
# (row 2q, row 2q+1) pairs of column c, then of column c + 1
PAIR_COLUMNS = 0x3120
# A head's softmax reference max moves only when the chunk's max exceeds it by more than this
# (log2 units): P <= 2**8 then, still far inside f16 and f32 with the value scales folded in,
# and most chunks need no rescale of the accumulators (skipped when no head of the CTA moved).
RESCALE_LOG2 = 8.0
# Per head groups: how many of the next chunk's 4 row groups the rope warp issues right after
# the chunk-head barrier (the rest after the softmax). With the whole gather there, its QK
# phase was the longest phase of the chunk (sm_120a, per thread, 16 heads: 259 against the
# nope warps' 143) and its PV phase the shortest (54 against 149); with 1 early group: 191 /
# 117. The late copies then have less than a chunk to land, which the 16-head kernel's third
# row stage covers; the 32-head kernel (two stages: sm_120's choice for many heads) issues all 4 early.
EARLY_ROW_GROUPS = {1: 1, 2: 4}
# QK's n tiles (8 entries each, 4 per chunk) multiplied at once per nope warp, their chains
# of 4 dependent MMAs interleaved (``tests/test_compile_sm120.py`` checks that no MMA of the
# f16 loops follows the one it accumulates onto): by (head groups, two_ctas_per_sm). All 4 in
# the one-group kernel without the register bound (one round of loads and chains instead of
# two: QK phase 123 -> 120 instructions, PV 129 -> 143; measured, session 11); 2 at the
# 128-register bound (4: 40 more instructions per chunk) and with two groups (8 chains), with
# or without the bound.
QK_TILES_AT_ONCE = {(1, False): 4, (1, True): 2, (2, False): 2, (2, True): 2}
# The rope warp takes all 4 at once (its B fragments are the raw bf16 rows, no conversion;
# still within the 128-register bound, no spills): its QK phase, with the gather the longest
# of the chunk, then has no NOP between dependent MMAs (measured: session 9 above). But 2 in the
# two-group kernel at the bound, where 4 needs more registers than it has (sm_90a: rope loop
# 633 -> 590 instructions, spill loads and stores 63 -> 34 over the kernel; H200, session 15:
# 64 x 128 x all 0.981-0.993x the time, the 24 shapes of 64 and 256 tokens 0.995x in
# geometric mean). Keyed as ``QK_TILES_AT_ONCE``.
ROPE_QK_TILES_AT_ONCE = {(1, False): 4, (1, True): 4, (2, False): 4, (2, True): 2}
# Late indices (``late_indices``, set in ``__init__``: true except in the one-group kernel held to
# the register bound, ``two_ctas_per_sm``): whether the rope warp issues the indices of chunk c +
# stages + 1 with chunk c's late rows (after the softmax, one cp.async group per chunk) instead
# of those of chunk c + stages right after the chunk-head barrier (the QK phase, its own group).
# Late in the kernel without the register bound (sm_120a, per chunk between barriers, one group:
# the rope warp's QK interval 160 -> 116 instructions against the nope warps' 120, its PV
# interval 126 -> 168 against their 145, so the longer of each 305 -> 288; two groups: QK 247 ->
# 199 against 178, PV 127 -> 177 against 198, 445 -> 397). H200 (session 12, two leases, old /
# new / old / new each): the 21 bench shapes of 1 to 64 tokens that run it 0.991x and 0.994x in
# geometric mean (1 x 16 x 1024 10.59 -> 10.34 us, 1 x 64 x 128+512 11.20 -> 11.04). At the
# bound (two CTAs per SM) the rope warp's loop is 400 instructions against the nope warps' 351
# and its PV phase would become the chunk's longest (184 against 138): 14 of the 15 shapes that
# run it were slower, by up to 1.7% (64 x 128 x 1024 105.8 -> 107.5), so early there (its SASS
# is the one before). The two-group kernel at the bound (session 15) keeps them late: early, the 24
# shapes of 64 and 256 tokens were 1.009x slower in geometric mean (64 x 128 x 1024 88.5 -> 89.4).


def _smem_scalar(dtype, addr):
    return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=dtype.width // 8),
                            cute.make_layout(1))


def _tree_sum(values: list):
    """The sum of ``values`` (traced vectors) as a balanced tree of adds (a plain function:
    its loop unrolls at trace time)."""
    while len(values) > 1:
        values = [values[k] + values[k + 1] for k in range(0, len(values) - 1, 2)] + values[len(values) - len(values) % 2:]
    return values[0]


class SparseMlaPartialF16Kernel(SparseMlaPartialKernel):
    """The "f16"-form partial kernel for one ``PartialConfig``."""

    INDEX_THREAD0 = ROPE_WARP * 32  # the rope warp issues the indices (``_issue_indices``) with its gather

    def __init__(self, cfg):
        super().__init__(cfg)
        # 8-entry row groups of the next chunk the rope warp issues right after the chunk-head
        # barrier; the rest after the softmax (see "the gather" below)
        self.early_row_groups = EARLY_ROW_GROUPS[cfg.head_groups]
        # where the rope warp issues the indices of a later chunk (``late_indices``): with the
        # late rows, stages + 1 chunks ahead (one cp.async group per chunk), or after the
        # chunk-head barrier, stages ahead (their own group, as ``_next_chunk``)
        self.late_indices = not (cfg.two_ctas_per_sm and cfg.head_groups == 1)
        self.index_chunks = cfg.stages + int(self.late_indices)
        # with stages + 1 buffers a late issue in chunk c writes chunk c's index buffer (its
        # indices were located at chunk c - stages + 1); the prologue fills one per chunk
        assert self.index_chunks <= self.slots

    def _allocate_s_exchange(self, smem):
        """Each warp's partial S for all heads of the CTA: [warp][head][F16_S_ROW] f32."""
        return smem.allocate_tensor(Float32, cute.make_layout(F16_WARPS * self.hb * F16_S_ROW), byte_alignment=128)

    @cute.kernel
    def kernel(
        self,
        q: cute.Pointer,
        q_stride_t: Int64,
        q_stride_h: Int64,
        num_heads: Int32,
        main_cache: cute.Pointer,
        main_page: Int32,
        main_page_magic: Int64,
        main_block_stride: Int64,
        main_num_slots: Int32,
        main_idx: cute.Pointer,
        main_idx_stride: Int64,
        main_topk: Int32,
        main_len: cute.Pointer,
        extra_cache: cute.Pointer,
        extra_page: Int32,
        extra_page_magic: Int64,
        extra_block_stride: Int64,
        extra_num_slots: Int32,
        extra_idx: cute.Pointer,
        extra_idx_stride: Int64,
        extra_topk: Int32,
        extra_len: cute.Pointer,
        sm_scale_log2: Float32,
        chunks_per_split: Int32,
        num_splits: Int32,
        o_part: cute.Pointer,
        lse_part: cute.Pointer,
        out: cute.Pointer,
        out_stride_t: Int64,
        out_stride_h: Int64,
        lse: cute.Pointer,
        lse_stride_t: Int64,
        lse_stride_h: Int64,
        attn_sink: cute.Pointer,
        kv_layout: cute.ComposedLayout,
        q_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        tiled_store: cute.TiledCopy,
        tiled_dequant: cute.TiledCopy,
    ):
        hb, mt = self.hb, self.groups
        if const_expr(not self.cfg.final_output):
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        token, head_block, split = self._block_coords(num_heads)
        warp_id = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        g = lane // 4
        qd = lane % 4
        head0 = head_block * hb

        smem = SmemAllocator()
        sP16 = smem.allocate_tensor(Uint8, cute.make_layout(hb * F16_P_ROW_BYTES), byte_alignment=128)
        sPbf = smem.allocate_tensor(Uint8, cute.make_layout(hb * F16_P_ROW_BYTES), byte_alignment=128)
        sCorr = smem.allocate_tensor(Float32, cute.make_layout(hb), byte_alignment=16)
        sGate = smem.allocate_tensor(Float32, cute.make_layout(hb), byte_alignment=16)
        sAmax = smem.allocate_tensor(Int32, cute.make_layout((hb, F16_WARPS), stride=(1, hb)), byte_alignment=16)
        ctx = self._gather_context(
            smem, tidx, token, split, chunks_per_split,
            (main_cache, main_page, main_page_magic, main_block_stride, main_num_slots, main_idx, main_idx_stride,
             main_topk, main_len),
            (extra_cache, extra_page, extra_page_magic, extra_block_stride, extra_num_slots, extra_idx,
             extra_idx_stride, extra_topk, extra_len),
        )
        c_begin, c_end = ctx.c_begin, ctx.c_end
        # output addresses taken at the top level (see _gather_context)
        o_part_addr, out_addr = o_part.toint(), out.toint()
        sink_addr, lse_part_addr, lse_addr = attn_sink.toint(), lse_part.toint(), lse.toint()
        # addresses at the top level (see _gather_context)
        bases = SimpleNamespace(p16=sP16.iterator.toint(), pbf=sPbf.iterator.toint(), s=ctx.sS.iterator.toint(),
                                corr=sCorr.iterator.toint(), gate=sGate.iterator.toint())

        # ---- Q: every warp loads its 64 columns as bf16 pairs; pair A / B of (m tile, row
        # half r, k16 step i) are the columns of A registers a0/a1 and a2/a3: nope warps
        # 4q, 4q+1 / 4q+2, 4q+3 (the order of the e4m3 bytes ldmatrix gives), the rope warp
        # 2q, 2q+1 / 8+2q, 9+2q (bf16's own order)
        qraw = cute.make_rmem_tensor(mt * 16, Int32)  # index ((m * 4 + i) * 2 + r) * 2 + pair
        off_a = 4 * qd
        off_b = 4 * qd + 2
        if warp_id == ROPE_WARP:
            off_a = 2 * qd
            off_b = 2 * qd + 8
        for m in cutlass.range_constexpr(mt):
            for r in cutlass.range_constexpr(2):
                head = head0 + 16 * m + g + 8 * r
                row = q.toint() + (Int64(token) * q_stride_t + Int64(head) * q_stride_h + warp_id * UNIT) * 2
                for i in cutlass.range_constexpr(4):
                    for pair in cutlass.range_constexpr(2):
                        col = 16 * i + (off_a if pair == 0 else off_b)
                        v = Int32(0)
                        if head < num_heads:
                            v = cute.make_tensor(cute.make_ptr(Int32, row + Int64(col) * 2, cute.AddressSpace.gmem,
                                                               assumed_align=4), cute.make_layout(1))[0]
                        qraw[((m * 4 + i) * 2 + r) * 2 + pair] = v

        self._start_pipeline(ctx, c_begin, c_end)

        # per-head largest |q| of each warp's columns (as f32 bits), for the f16 scale of Q
        for m in cutlass.range_constexpr(mt):
            for r in cutlass.range_constexpr(2):
                amax = Int32(0)
                for i in cutlass.range_constexpr(4):
                    for pair in cutlass.range_constexpr(2):
                        v = qraw[((m * 4 + i) * 2 + r) * 2 + pair]
                        amax = cutlass.max(amax, cutlass.max((v << 16) & 0x7FFFFFFF, v & 0x7FFF0000))
                amax = self._quad_allreduce(amax, cutlass.max)
                if qd == 0:
                    sAmax[16 * m + g + 8 * r, warp_id] = amax
        cute.arch.sync_threads()

        if warp_id < ROPE_WARP:
            self._nope_role(ctx, bases, qraw, sAmax, warp_id, lane, tidx, token, split, head0, num_heads,
                            sm_scale_log2, c_begin, c_end, num_splits, o_part_addr, lse_part_addr, out_addr,
                            out_stride_t, out_stride_h, lse_addr, lse_stride_t, lse_stride_h, sink_addr)
        else:
            self._rope_role(ctx, bases, qraw, sAmax, lane, tidx, token, split, head0, num_heads,
                            sm_scale_log2, c_begin, c_end, num_splits, o_part_addr, lse_part_addr, out_addr,
                            out_stride_t, out_stride_h, lse_addr, lse_stride_t, lse_stride_h, sink_addr)

    # ------------------------------------------------------------------ the gather
    # The gather is the rope warp's alone: each thread of 256 issuing its share cost every
    # nope warp ~130 instructions per chunk (the index check, a division by the runtime page
    # size, the addresses) for ~5 copies. Lane l locates entry l (one division); then for
    # each group of 8 entries, lane 4 r + p copies pieces p, p + 4, .. of entry 8 j + r (each
    # warp-wide copy: 64 contiguous bytes of 8 rows). An invalid entry's row and scales are
    # zero-filled by the same copies (src-size 0: nothing is read). In the main loop the
    # rope warp issues the first ``early_row_groups`` of the 4 groups after the chunk-head
    # barrier and the rest after the softmax, where it has the fewest instructions (with
    # ``late_indices`` also the indices of chunk c + stages + 1 there: ``_rope_role``).

    @cute.jit
    def _locate_rows(self, ctx, c: Int32, buf: Int32):
        """(validity mask, this lane's row address, its scales' address) of chunk ``c``, whose
        indices are in ``sIdx[:, buf]``; the mask also into ``sMask[buf]`` (by thread
        ROPE_WARP * 32). An invalid entry gets slot 0's addresses (the copies read nothing)."""
        tidx, sMask = ctx.tidx, ctx.sMask
        lane = tidx % 32
        pos0, _, _, limit, num_slots, page, magic, block_stride, base = self._chunk_source(ctx, c)
        slot = self._valid_slot(ctx, lane, buf, pos0, limit, num_slots)
        mask = cute.arch.vote_ballot_sync(slot >= 0)
        if tidx == ROPE_WARP * 32:
            sMask[buf] = mask
        row_addr, scale_addr = self._row_location(cutlass.max(slot, 0), page, magic, block_stride, base)
        return mask, row_addr, scale_addr

    def _copy_rows(self, stage_base, located, lane, groups, scales: bool):
        """cp.async of the 8-entry groups ``groups`` of a located chunk (``_locate_rows``)
        into the stage at ``stage_base``; ``scales``: also each lane's entry's scales."""
        mask, row_addr, scale_addr = located
        if scales:
            cp_async_zfill(stage_base + self.scale_off + lane * SCALE_BYTES, scale_addr, SCALE_BYTES,
                           ((mask >> lane) & 1) * 8)
        addr_lo = Int32(row_addr & 0xFFFFFFFF)
        addr_hi = Int32(row_addr >> 32)
        r = lane // 4
        p = lane % 4
        for j in groups:
            e = 8 * j + r
            src = (Int64(cute.arch.shuffle_sync(addr_hi, e)) << 32) | (
                Int64(cute.arch.shuffle_sync(addr_lo, e)) & 0xFFFFFFFF)
            nbytes = ((mask >> e) & 1) * 16
            dst = stage_base + e * RAW_ROW_STRIDE
            for k in range(ROW_BYTES // 64):
                piece = 16 * (p + 4 * k)
                cp_async_zfill(dst + piece, src + piece, 16, nbytes)

    @cute.jit
    def _start_next_chunk(self, ctx, c: Int32, c_end: Int32, step: Int32, lane: Int32):
        """The rope warp's first part of the per-chunk gather: without ``late_indices`` chunk
        c + stages's indices (their own cp.async group); chunk c + stages - 1 located and its
        first ``early_row_groups`` groups of rows (and the scales) started. Returns the
        location for ``_copy_rows`` of the other groups. (Located even past c_end: into a
        mask buffer no chunk in use reads; nothing is copied for it.)"""
        ahead = self.stages - 1
        if const_expr(not self.late_indices):
            if c + ahead + 1 < c_end:
                self._issue_indices(ctx, c + ahead + 1, (step + ahead + 1) % self.slots)
            cute.arch.cp_async_commit_group()
        stage = (step + ahead) % self.stages
        located = self._locate_rows(ctx, c + ahead, (step + ahead) % self.slots)
        stage_base = ctx.raw_base + stage * self.stage_bytes
        if const_expr(self.early_row_groups > 0):
            if c + ahead < c_end:
                self._copy_rows(stage_base, located, lane, range(self.early_row_groups), scales=True)
        return located

    # ------------------------------------------------------------------ the two roles
    @cute.jit
    def _nope_role(self, ctx, bases, qraw, sAmax, w, lane, tidx, token, split, head0, num_heads, sm_scale_log2,
                   c_begin, c_end, num_splits, o_part, lse_part, out, out_stride_t, out_stride_h, lse,
                   lse_stride_t, lse_stride_h, attn_sink):
        """Warps 0..6: nope tile w of QK and of the output, and their share of the softmax."""
        ctx, bases, corr_base, g, qd = self._role_start(ctx, bases, lane)
        mt = self.groups
        # Q as f16 A fragments: index (m * 4 + i) * 4 + a
        qf = cute.make_rmem_tensor(mt * 16, Int32)
        for m in cutlass.range_constexpr(mt):
            for r in cutlass.range_constexpr(2):
                qscale = pow2_f32(Q_F16_EXP - self._head_exponent(sAmax, 16 * m + g + 8 * r))
                for i in cutlass.range_constexpr(4):
                    for pair in cutlass.range_constexpr(2):
                        qbits = qraw[((m * 4 + i) * 2 + r) * 2 + pair]
                        qf[(m * 4 + i) * 4 + 2 * pair + r] = pack_f16x2(f32_from_bits(qbits << 16) * qscale,
                                                                        f32_from_bits(qbits & -65536) * qscale)
        sm = self._softmax_state(sAmax, tidx, sm_scale_log2)
        acc_O = cute.make_rmem_tensor(mt * 32, Float32)  # index ((m * 4 + blk) * 2 + parity) * 4 + c
        acc_O.fill(0.0)
        r_byte = cute.make_rmem_tensor(1, Int32)  # R_w: running max of this tile's scale byte
        r_byte.fill(0)
        sbytes = cute.make_rmem_tensor(8, Int32)  # this thread's entries 8 nb + 2 q + i at 2 nb + i
        k_row = (lane % 8) * RAW_ROW_STRIDE + (lane // 8) * 16 + w * UNIT  # ldmatrix row of QK
        v_row = lane * RAW_ROW_STRIDE + w * UNIT  # ldmatrix.trans row of PV
        # this thread's share of the first stages - 1 chunks' rows (``_issue_rows``, one
        # cp.async group each; the nope warps copy nothing later): chunk c_begin's landed
        # before its barrier, the next one's at the end of the first iteration (later a wait
        # for nothing)
        cute.arch.cp_async_wait_group(self.stages - 2)
        for c in cutlass.range(c_begin, c_end, 1, unroll=1):
            step = c - c_begin
            buf = step % self.slots
            self._next_chunk(ctx, c, c_end, step, issue=False)
            stage_base = ctx.raw_base + (step % self.stages) * self.stage_bytes
            valid_rows = ctx.sMask[buf]
            scale_base = stage_base + self.scale_off
            for nb in cutlass.range_constexpr(4):
                for i in cutlass.range_constexpr(2):
                    sbytes[2 * nb + i] = load_smem_u8(scale_base + (8 * nb + 2 * qd + i) * SCALE_BYTES + w)
            mine = load_smem_u8(scale_base + lane * SCALE_BYTES + w)
            if (valid_rows >> lane) & 1 == 0:
                mine = Int32(0)
            r_old = r_byte[0]
            r_new = cutlass.max(r_old, warp_max_u32(mine))
            r_byte[0] = r_new

            # S_w = Q_w K_w^T times each entry's scale; n tiles in pairs, their MMA chains
            # interleaved (one tile at a time, ptxas issued the 16 MMAs back to back on one
            # accumulator, each waiting for the one before)
            at_once = QK_TILES_AT_ONCE[mt, self.cfg.two_ctas_per_sm]
            for nb0 in cutlass.range_constexpr(0, 4, at_once):
                tiles = range(nb0, nb0 + at_once)
                b = {}
                for nb in tiles:
                    kb = ldsm_x4(stage_base + k_row + 8 * nb * RAW_ROW_STRIDE, trans=False)
                    b[nb] = [e4m3x4_to_f16x2(kb[i]) for i in range(4)]
                for m in cutlass.range_constexpr(mt):
                    d = {nb: [Float32(0.0)] * 4 for nb in tiles}
                    for i in cutlass.range_constexpr(4):
                        for nb in tiles:
                            d[nb] = mma_f16(d[nb], [qf[(m * 4 + i) * 4 + a] for a in range(4)], b[nb][i])
                    for nb in tiles:
                        kf = [ue8m0_scale(sbytes[2 * nb + i]) for i in range(2)]
                        self._store_s_part(bases, w, m, nb, lane, [d[nb][0] * kf[0], d[nb][1] * kf[1],
                                                                   d[nb][2] * kf[0], d[nb][3] * kf[1]])
            cute.arch.sync_threads()
            moved = self._softmax_step(sm, bases, valid_rows, tidx, step)

            # O_w = O_w * correction * 2**(R_old - R_new) + P' V_w
            # P' scale pairs: k16 step s, entries 16 s + 2 q + {0, 1} (n tile 2 s) and
            # 16 s + 8 + 2 q + {0, 1} (n tile 2 s + 1)
            # 2**(b - R_w) as (b << 23) + ((127 - R_w) << 23): one multiply-add and a max per byte
            r_bits = (127 - r_new) << 23
            pfac = [pack_f16x2(*[pow2_f32_bits(sbytes[2 * nt + i] * (1 << 23) + r_bits) for i in range(2)])
                    for nt in range(4)]
            pa = []
            for m in cutlass.range_constexpr(mt):
                for s in cutlass.range_constexpr(2):
                    pfr = self._load_p(bases.p16, m, s, lane)
                    pa.append([mul_f16x2(pfr[0], pfac[2 * s]), mul_f16x2(pfr[1], pfac[2 * s]),
                               mul_f16x2(pfr[2], pfac[2 * s + 1]), mul_f16x2(pfr[3], pfac[2 * s + 1])])
            # the rescale only when a head's reference max or R_w moved (CTA- / warp-uniform),
            # in a loop of 0 or 1 pass: ptxas predicated an `if` around it (both paths issued).
            # (Measured, H200: giving each path its own copy of the MMAs, which saves the ~60
            # register moves ptxas puts where the paths meet with 32 heads, was 3-5% slower.)
            for _ in cutlass.range(moved | Int32(r_new != r_old), unroll=1):
                self._rescale(acc_O, corr_base, pow2_f32(r_old - r_new), g)
            self._nope_pv(acc_O, pa, stage_base + v_row)
            cute.arch.cp_async_wait_group(0)

        self._finish_softmax(sm, bases, tidx, token, split, head0, num_heads, num_splits, lse_part, lse,
                             lse_stride_t, lse_stride_h, attn_sink)
        # column 64 w + 16 blk + 4 q + k of row (m, r) is accumulator ((m * 4 + blk) * 2 + k % 2) * 4
        # + 2 r + k // 2, in units of 2**(R_w - 127)
        def pieces(m, r):
            return [(w * UNIT + 16 * blk + 4 * qd, [((m * 4 + blk) * 2 + k % 2) * 4 + 2 * r + k // 2 for k in range(4)])
                    for blk in range(4)]

        self._store_outputs(acc_O, ue8m0_scale(r_byte[0]), pieces, bases, lane, token, split, head0, num_heads,
                            num_splits, o_part, out, out_stride_t, out_stride_h)

    def _rescale(self, acc_O, corr_base, ratio, g):
        """acc_O of this thread's head rows (16 m + g + 8 r) times the row's correction (shared
        memory) times ``ratio`` (both roles keep row r of m tile m at m * 32 + 4 j + 2 r + {0, 1})."""
        for m in range(self.groups):
            for r in range(2):
                fo = _smem_scalar(Float32, corr_base + (16 * m + g + 8 * r) * 4)[0] * ratio
                for k in range(16):
                    idx = m * 32 + 4 * (k // 2) + 2 * r + k % 2
                    acc_O[idx] = acc_O[idx] * fo

    def _nope_pv(self, acc_O, pa, v_base):
        """acc_O += P' V_w for one chunk: the value fragments by ``ldmatrix.x4.trans`` of the
        raw rows from ``v_base`` (entries 0-7, 8-15, 16-23, 24-31 of 16 columns), one byte
        permute into (row 2q, row 2q + 1) pairs, then even and odd columns as two MMAs."""
        for blk in range(4):
            vfrag = ldsm_x4(v_base + 16 * blk, trans=True)
            bv = [e4m3x4_to_f16x2(vfrag[k], PAIR_COLUMNS) for k in range(4)]  # [even column, odd column]
            for parity in range(2):
                for m in range(self.groups):
                    base = ((m * 4 + blk) * 2 + parity) * 4
                    d = [acc_O[base + k] for k in range(4)]
                    for s in range(2):
                        d = mma_f16(d, pa[m * 2 + s], [bv[2 * s][parity], bv[2 * s + 1][parity]])
                    for k in range(4):
                        acc_O[base + k] = d[k]

    def _rope_pv(self, acc_O, pa, v_base):
        """acc_O += P V_rope for one chunk (bf16 P, the raw bf16 rope rows by ``ldmatrix.trans``)."""
        for n in range(8):
            vfrag = ldsm_x4(v_base + 16 * n, trans=True)  # entries 0-7, 8-15 (step 0), 16-31 (step 1)
            for m in range(self.groups):
                d = [acc_O[(m * 8 + n) * 4 + k] for k in range(4)]
                for s in range(2):
                    d = mma_bf16(d, pa[m * 2 + s], vfrag[2 * s:2 * s + 2])
                for k in range(4):
                    acc_O[(m * 8 + n) * 4 + k] = d[k]

    @cute.jit
    def _rope_role(self, ctx, bases, qraw, sAmax, lane, tidx, token, split, head0, num_heads, sm_scale_log2,
                   c_begin, c_end, num_splits, o_part, lse_part, out, out_stride_t, out_stride_h, lse,
                   lse_stride_t, lse_stride_h, attn_sink):
        """Warp 7: the 64 rope dims of QK and of the output (bf16), and its share of the softmax."""
        ctx, bases, corr_base, g, qd = self._role_start(ctx, bases, lane)
        mt = self.groups
        sm = self._softmax_state(sAmax, tidx, sm_scale_log2)
        acc_O = cute.make_rmem_tensor(mt * 32, Float32)  # index (m * 8 + n) * 4 + c
        acc_O.fill(0.0)
        # ldmatrix rows: QK lane 8 i + r -> entry r, rope bytes 16 i.. (k16 steps 2 x, 2 x + 1
        # per x4); PV lane l -> entry l
        k_row = (lane % 8) * RAW_ROW_STRIDE + ROPE_BYTE0 + (lane // 8) * 16
        v_row = lane * RAW_ROW_STRIDE + ROPE_BYTE0
        for c in cutlass.range(c_begin, c_end, 1, unroll=1):
            step = c - c_begin
            buf = step % self.slots
            # chunk c's rows and c + stages - 1's indices; in flight stay the rows of chunk
            # c + stages - 2 (and with late_indices, in the same group, chunk c + stages's indices)
            cute.arch.cp_async_wait_group(self.stages - 2)
            self._next_chunk(ctx, c, c_end, step, issue=False)
            stage_base = ctx.raw_base + (step % self.stages) * self.stage_bytes
            next_base = ctx.raw_base + ((step + self.stages - 1) % self.stages) * self.stage_bytes
            valid_rows = ctx.sMask[buf]
            if const_expr(self.early_row_groups > 0):
                located = self._start_next_chunk(ctx, c, c_end, step, lane)
            at_once = ROPE_QK_TILES_AT_ONCE[mt, self.cfg.two_ctas_per_sm]
            for nb0 in cutlass.range_constexpr(0, 4, at_once):  # as in the nope role
                tiles = range(nb0, nb0 + at_once)
                kb = {nb: [] for nb in tiles}
                for nb in tiles:
                    for x in cutlass.range_constexpr(2):
                        kb[nb] += ldsm_x4(stage_base + k_row + 8 * nb * RAW_ROW_STRIDE + 64 * x, trans=False)
                for m in cutlass.range_constexpr(mt):
                    d = {nb: [Float32(0.0)] * 4 for nb in tiles}
                    for i in cutlass.range_constexpr(4):
                        a = [qraw[((m * 4 + i) * 2 + (k % 2)) * 2 + k // 2] for k in range(4)]
                        for nb in tiles:
                            d[nb] = mma_bf16(d[nb], a, kb[nb][2 * i:2 * i + 2])
                    for nb in tiles:
                        self._store_s_part(bases, ROPE_WARP, m, nb, lane, d[nb])
            cute.arch.sync_threads()
            moved = self._softmax_step(sm, bases, valid_rows, tidx, step)
            # the rest of the next chunk's gather here: the rope warp's shortest phase
            if const_expr(self.early_row_groups == 0):
                located = self._start_next_chunk(ctx, c, c_end, step, lane)
            if c + self.stages - 1 < c_end:
                self._copy_rows(next_base, located, lane, range(self.early_row_groups, self.bn // 8),
                                scales=self.early_row_groups == 0)
            if const_expr(self.late_indices):
                # chunk c + stages + 1's indices, in the same cp.async group as these rows (one
                # group per chunk): located two chunks from now, after the wait that lands it
                if c + self.stages + 1 < c_end:
                    self._issue_indices(ctx, c + self.stages + 1, (step + self.stages + 1) % self.slots)
            cute.arch.cp_async_commit_group()

            pa = [self._load_p(bases.pbf, m, s, lane) for m in range(mt) for s in range(2)]
            for _ in cutlass.range(moved, unroll=1):  # as in the nope role
                self._rescale(acc_O, corr_base, Float32(1.0), g)
            self._rope_pv(acc_O, pa, stage_base + v_row)

        self._finish_softmax(sm, bases, tidx, token, split, head0, num_heads, num_splits, lse_part, lse,
                             lse_stride_t, lse_stride_h, attn_sink)
        # column 448 + 8 n + 2 q + i of row (m, r) is accumulator (m * 8 + n) * 4 + 2 r + i
        def pieces(m, r):
            return [(D_NOPE + 8 * n + 2 * qd, [(m * 8 + n) * 4 + 2 * r + i for i in range(2)]) for n in range(8)]

        self._store_outputs(acc_O, Float32(1.0), pieces, bases, lane, token, split, head0, num_heads, num_splits,
                            o_part, out, out_stride_t, out_stride_h)

    # ------------------------------------------------------------------ shared steps
    @staticmethod
    def _role_start(ctx, bases, lane):
        """What both roles start with: their own namespaces (the tracer rebinds the attributes
        of a namespace passed into a helper with a branch to that branch's results, which the
        other role's code, another region, must not see), the corrections' address (read
        before any branch) and the lane's MMA fragment coordinates (g, q)."""
        ctx, bases = SimpleNamespace(**vars(ctx)), SimpleNamespace(**vars(bases))
        return ctx, bases, bases.corr, lane // 4, lane % 4

    @cute.jit
    def _head_exponent(self, sAmax, hrow) -> Int32:
        """E_h: the exponent of head row ``hrow``'s largest |q| over the nope dims, clamped so
        that every power of two built from it is a normal f32."""
        amax = sAmax[hrow, 0]
        for w in cutlass.range_constexpr(1, ROPE_WARP):
            amax = cutlass.max(amax, sAmax[hrow, w])
        return cutlass.min(cutlass.max((amax >> 23) - 127, -100), 127)

    @cute.jit
    def _store_s_part(self, bases, w, m, nb, lane, d):
        """A warp's partial S of n tile nb, m tile m (C fragment ``d``) into its [head][entry] rows."""
        g = lane // 4
        qd = lane % 4
        for r in cutlass.range_constexpr(2):
            addr = bases.s + ((w * self.hb + 16 * m + g + 8 * r) * F16_S_ROW + 8 * nb + 2 * qd) * 4
            v = cute.make_rmem_tensor(2, Float32)
            v[0] = d[2 * r]
            v[1] = d[2 * r + 1]
            cute.autovec_copy(v, _smem_vec(Float32, addr, 2))

    @cute.jit
    def _load_p(self, p_base, m, s, lane):
        """The A fragment of P (m16 tile m, k16 step s) by ``ldmatrix.x4``: lane 8 i + r gives
        row r (+ 8 for matrices 1, 3), entries 16 s (+ 8 for matrices 2, 3)."""
        row = 16 * m + lane % 8 + 8 * ((lane // 8) % 2)
        col = 16 * s + 8 * (lane // 16)
        return ldsm_x4(p_base + row * F16_P_ROW_BYTES + col * 2, trans=False)

    def _softmax_geometry(self):
        """(entries per thread, threads per head row) of the spread softmax."""
        ept = self.hb * self.bn // self.nthr
        return ept, self.bn // ept

    @cute.jit
    def _softmax_state(self, sAmax, tidx, sm_scale_log2):
        """This thread's head row of the softmax, its running max / partial sum, and the
        factors that turn the summed partials into log2-domain scores."""
        ept, tpr = self._softmax_geometry()
        hrow = tidx // tpr
        e = self._head_exponent(sAmax, hrow)
        run = cute.make_rmem_tensor(2, Float32)  # running max (log2 units), this thread's partial sum
        run[0] = -Float32.inf
        run[1] = Float32(0.0)
        return SimpleNamespace(hrow=hrow, j0=(tidx % tpr) * ept, run=run,
                               nope_fac=pow2_f32(e - Q_F16_EXP) * sm_scale_log2, rope_fac=sm_scale_log2)

    @cute.jit
    def _softmax_step(self, sm, bases, valid_rows, tidx, step):
        """Scores of this thread's entries from the 8 partials, the online softmax over its
        head row, P (f16 and bf16) and the row's rescale factor into shared memory, visible to
        the CTA on return; returns 1 (every thread) when some head's reference max moved
        (``RESCALE_LOG2``), else 0.

        After the first chunk a head's max rarely moves, so P is first computed against the
        old max without the row's max: each thread only tests its own entries against
        ``m_old + RESCALE_LOG2`` and the P barrier ORs the tests (``sync_threads_or``). Only
        when one is set (CTA-uniform) does the exact step below run (the row max by shuffles,
        P again, a second barrier); every value it leaves is the one the step without the
        test computes. The first chunk goes to it directly (every max moves there)."""
        ept, tpr = self._softmax_geometry()
        hrow, j0, run = sm.hrow, sm.j0, sm.run
        s_base, p16_base, pbf_base, corr_addr = bases.s, bases.p16, bases.pbf, bases.corr + hrow * 4
        parts = []  # the 7 nope partials then the rope one, each [ept]
        for w in cutlass.range_constexpr(F16_WARPS):
            v = cute.make_rmem_tensor(ept, Float32)
            cute.autovec_copy(_smem_vec(Float32, s_base + ((w * self.hb + hrow) * F16_S_ROW + j0) * 4, ept), v)
            parts.append(v.load())
        part = cute.make_rmem_tensor(ept, Float32)
        part.store(parts.pop())
        acc = cute.make_rmem_tensor(ept, Float32)  # the scores (log2 units), -inf where invalid
        acc.store(_tree_sum(parts))  # 3 dependent adds, not 6
        for e in cutlass.range_constexpr(ept):
            s = acc[e] * sm.nope_fac + part[e] * sm.rope_fac
            if (valid_rows >> (j0 + e)) & 1 == 0:
                s = -Float32.inf
            acc[e] = s
        p = cute.make_rmem_tensor(ept, Float32)
        p_offset = hrow * F16_P_ROW_BYTES + j0 * 2
        m_old = run[0]
        moved = Int32(1)
        if step != 0:
            m_base = m_old
            if m_old == -Float32.inf:
                m_base = Float32(0.0)
            exceeds = Int32(0)
            for e in cutlass.range_constexpr(ept):
                exceeds = exceeds | Int32(acc[e] > m_old + RESCALE_LOG2)
            psum = self._write_p(acc, m_base, Float32(1.0), p, p16_base, pbf_base, p_offset, corr_addr, tidx)
            moved = cute.arch.make_warp_uniform(sync_threads_or(exceeds))
            if moved == 0:
                run[1] = run[1] + psum
        if moved != 0:
            m_chunk = -Float32.inf
            for e in cutlass.range_constexpr(ept):
                m_chunk = cute.arch.fmax(m_chunk, acc[e])
            off = tpr // 2
            while off >= 1:
                m_chunk = cute.arch.fmax(m_chunk, cute.arch.shuffle_sync_bfly(m_chunk, offset=off, mask=-1,
                                                                               mask_and_clamp=31))
                off //= 2
            m_new = m_old
            if m_chunk > m_old + RESCALE_LOG2:
                m_new = m_chunk
            m_base = m_new
            if m_new == -Float32.inf:
                m_base = Float32(0.0)
            corr = cute.math.exp2(m_old - m_base, fastmath=True)
            psum = self._write_p(acc, m_base, corr, p, p16_base, pbf_base, p_offset, corr_addr, tidx)
            run[1] = run[1] * corr + psum
            run[0] = m_new
            cute.arch.sync_threads()
        return moved

    @cute.jit
    def _write_p(self, acc, m_base, corr, p, p16_base, pbf_base, p_offset, corr_addr, tidx):
        """P = 2**(score - m_base) of this thread's entries into ``p`` and the P rows, the
        head row's rescale factor ``corr`` (by its first thread); returns the entries' sum.
        Both softmax paths (against the old max, and the exact step) write P through this."""
        ept, tpr = self._softmax_geometry()
        psum = Float32(0.0)
        for e in cutlass.range_constexpr(ept):
            p[e] = cute.math.exp2(acc[e] - m_base, fastmath=True)
            psum = psum + p[e]
        self._store_p(p, p16_base, pbf_base, p_offset)
        if tidx % tpr == 0:
            _smem_scalar(Float32, corr_addr)[0] = corr
        return psum

    @cute.jit
    def _store_p(self, p, p16_base, pbf_base, offset):
        """This thread's P values into the f16 and the bf16 P rows (``offset`` bytes in)."""
        ept, _ = self._softmax_geometry()
        words16 = cute.make_rmem_tensor(ept // 2, Int32)
        words_bf = cute.make_rmem_tensor(ept // 2, Int32)
        for k in cutlass.range_constexpr(ept // 2):
            words16[k] = pack_f16x2(p[2 * k], p[2 * k + 1])
            words_bf[k] = pack_bf16x2(p[2 * k], p[2 * k + 1])
        cute.autovec_copy(words16, _smem_vec(Int32, p16_base + offset, ept // 2))
        cute.autovec_copy(words_bf, _smem_vec(Int32, pbf_base + offset, ept // 2))

    @cute.jit
    def _finish_softmax(self, sm, bases, tidx, token, split, head0, num_heads, num_splits, lse_part, lse,
                        lse_stride_t, lse_stride_h, attn_sink, dbg=False):
        """The row sums, each head's output factor into shared memory (visible on return) and
        its lse to global memory."""
        if const_expr(dbg):
            return
        ept, tpr = self._softmax_geometry()
        hrow, run = sm.hrow, sm.run
        total = run[1]
        off = tpr // 2
        while off >= 1:
            total = total + cute.arch.shuffle_sync_bfly(total, offset=off, mask=-1, mask_and_clamp=31)
            off //= 2
        head = head0 + hrow
        gate_addr = bases.gate + hrow * 4
        if tidx % tpr == 0:
            if head < num_heads:
                gate, lse2 = self._gate_and_lse2(total, run[0], attn_sink, head)
                _smem_scalar(Float32, gate_addr)[0] = gate
                self._store_lse(total, lse2, token, split, num_splits, num_heads, head, lse_part, lse,
                                lse_stride_t, lse_stride_h)
        cute.arch.sync_threads()

    @cute.jit
    def _store_outputs(self, acc_O, unit, pieces, bases, lane, token, split, head0, num_heads, num_splits,
                       o_part, out, out_stride_t, out_stride_h):
        """This thread's output values, in units of ``unit`` times each head's gate:
        ``pieces(m, r)`` lists (first column, accumulator indices of adjacent columns) of row r
        of m tile m."""
        g = lane // 4
        gate_base = bases.gate
        for m in cutlass.range_constexpr(self.groups):
            for r in cutlass.range_constexpr(2):
                hrow = 16 * m + g + 8 * r
                if head0 + hrow < num_heads:
                    fg = _smem_scalar(Float32, gate_base + hrow * 4)[0] * unit
                    for col, idx in pieces(m, r):
                        self._store_out([acc_O[k] * fg for k in idx], col, token, split, num_splits, num_heads,
                                        head0 + hrow, o_part, out, out_stride_t, out_stride_h)

    @cute.jit
    def _store_out(self, vals, col, token, split, num_splits, num_heads, head, o_part, out, out_stride_t,
                   out_stride_h):
        """``len(vals)`` adjacent output values from column ``col``: bf16 out (final mode) or
        the f32 split partial (``out`` / ``o_part``: their addresses)."""
        n = len(vals)
        if const_expr(self.cfg.final_output):
            v = cute.make_rmem_tensor(n, BFloat16)
            for k in cutlass.range_constexpr(n):
                v[k] = BFloat16(vals[k])
            addr = out + (Int64(token) * out_stride_t + Int64(head) * out_stride_h + Int64(col)) * 2
            dst = cute.make_tensor(cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=2 * n),
                                   cute.make_layout(n))
        else:
            v = cute.make_rmem_tensor(n, Float32)
            for k in cutlass.range_constexpr(n):
                v[k] = vals[k]
            addr = o_part + (((Int64(token) * num_splits + split) * num_heads + head) * D_QK + col) * 4
            dst = cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4 * n),
                                   cute.make_layout(n))
        cute.autovec_copy(v, dst)
