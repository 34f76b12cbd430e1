"""Every tuning constant of the kernels and of the dispatch, each with its reason in one line.

A tuning constant is a choice made by measurement (the alternatives compute the same result).
Each one's reason ends in a bracketed anchor (``[rescale_log2]``); ``docs/tuning.md`` has an
entry under a heading of exactly that text (a few related constants share one): the rule, the
measurement that decided it, the commit and date. Facts of the design (tile
sizes that the fragment layouts fix, conflict-free strides) live with the code they shape.
"""

# ---------------------------------------------------------------- compute path
# "f16" on every GPU: faster than "bf16" on every bench shape and as accurate.  [default_precision]
DEFAULT_PRECISION = "f16"

# ---------------------------------------------------------------- partial kernels
# "f16" one-group kernel: 3 raw row stages (its late row copies need more than a chunk to
# land); every other kernel 2 (the "f16" two-group kernel has no room for 3 in 99 KB).  [row_stages]
F16_ONE_GROUP_STAGES = 3
OTHER_STAGES = 2
# "f16": a head's reference max moves only when a chunk's max exceeds it by more than this
# (log2 units): P <= 2**8, and most chunks skip the rescale of the accumulators.  [rescale_log2]
RESCALE_LOG2 = 8.0
# "f16", by head groups: how many of the next chunk's 4 row groups the rope warp issues right
# after the chunk-head barrier (the rest after the softmax), evening out its phases.  [early_row_groups]
EARLY_ROW_GROUPS = {1: 1, 2: 4}
# "f16", by (head groups, two_ctas_per_sm): QK n tiles per nope warp at once, so that chains
# of dependent MMAs interleave (4 only without the register bound).  [qk_tiles_at_once]
F16_QK_TILES_AT_ONCE = {(1, False): 4, (1, True): 2, (2, False): 2, (2, True): 2}
# "f16" with two UE8M0 scales per nope tile (DeepSeek-V4.1 FP8: two accumulators per n tile),
# by head groups: with 32 heads one n tile at a time (two spilled on sm_120a).  [qk_tiles_at_once]
F16_QK_TILES_AT_ONCE_TWO_SCALES = {1: 4, 2: 1}
# "f16": the same for the rope warp (raw bf16 operands); 2 where 4 would spill.  [rope_qk_tiles_at_once]
F16_ROPE_QK_TILES_AT_ONCE = {(1, False): 4, (1, True): 4, (2, False): 4, (2, True): 2}
# "f16": the rope warp issues a later chunk's indices with the late rows (one chunk further
# ahead) except in the one-group kernel held to 128 registers, where that made it slower.  [late_indices]
def f16_late_indices(head_groups: int, two_ctas_per_sm: bool) -> bool:
    return not (two_ctas_per_sm and head_groups == 1)


# "fp8" / "mxf8": QK n tiles at once (two interleaved chains of e4m3 MMAs).  [fp8_qk_tiles_at_once]
FP8_QK_TILES_AT_ONCE = 2
# "bf16": columns one thread dequantizes at a time (one 16-byte e4m3 load and one scale).  [dequant_values]
DEQUANT_VALUES = 16

# ---------------------------------------------------------------- merge kernel
# splits whose partial outputs a merge thread loads at once, the first batch with the lse
# values: 8 keeps many merge CTAs per SM, 32 serves the many-split calls of few tokens.  [merge_batches]
MERGE_BATCHES = (8, 32)

# ---------------------------------------------------------------- work split (dispatch.policy.splits)
# one chunk per split when the grid needs splits at all.  [min_chunks_per_split]
MIN_CHUNKS_PER_SPLIT = 1
# a token's planned splits at most the merge's largest batch, which it loads with the lse values
# in one round trip: more splits cost the merge a round trip per batch.  [max_planned_splits]
MAX_PLANNED_SPLITS = MERGE_BATCHES[-1]
# CTAs of this many chunks or fewer, two to an SM: one CTA per SM with more chunks instead;
# where that leaves two splits, one split and no merge.  [max_chunks_two_per_sm]
MAX_CHUNKS_TWO_PER_SM = 3
# a call with a length tensor (its chunks dealt by the lengths, which the host does not know)
# whose grid of more chunks would put two CTAs on an SM: one CTA per SM instead where that
# still gives each token this many splits (a list wider than its lengths, vLLM's ratio-128
# rows, leaves most CTAs one chunk or none).  [min_dealt_splits_one_per_sm]
MIN_DEALT_SPLITS_ONE_PER_SM = 8

# ---------------------------------------------------------------- head groups (dispatch.policy.head_groups)
# "bf16" / FP8 paths: 32-head CTAs from this many 16-head blocks per call with this many
# entries per token (or whenever the 16-head blocks outnumber the SMs).  [two_groups_min_blocks]
TWO_GROUPS_MIN_BLOCKS = 32
TWO_GROUPS_MIN_ENTRIES = 256
# "f16" where an SM holds one of its CTAs (sm_120): the same rule with these thresholds.  [f16_two_groups_min_blocks]
F16_TWO_GROUPS_MIN_BLOCKS = 64
F16_TWO_GROUPS_MIN_ENTRIES = 512
# "f16" where an SM holds two 128-register CTAs (the H200): 32-head CTAs where they fill at
# least this fraction (numerator, denominator) of the slots without a split ...  [f16_bounded_two_groups]
F16_BOUNDED_TWO_GROUPS_MIN_FILL = (3, 4)
# ... or, both grids split, where each 32-head CTA gets at least this many chunks ...
F16_BOUNDED_TWO_GROUPS_MIN_SPLIT_CHUNKS = 7
# ... or, the 16-head grid unsplit, where num / den of the 32-head CTAs' chunks plus this
# many stay within the 16-head CTAs' chunks (a 32-head chunk costs 1.6 of a 16-head one).
F16_BOUNDED_TWO_GROUPS_CHUNK_COST = (8, 5)
F16_BOUNDED_TWO_GROUPS_SPLIT_COST_CHUNKS = 7
