"""The DeepSeek-V4 "MODEL1" FP8 sparse-MLA cache layout, as numbers.

Per page block of P tokens (FlashMLA's sparse FP8 "MODEL1" layout):

- bytes ``[0, P*576)``: token t at ``t*576``: 448 FP8 e4m3 bytes (the "nope" dims, 7 tiles
  of 64), then 64 bf16 "rope" values (128 bytes);
- bytes ``[P*576, P*584)``: token t's scales at ``P*576 + t*8``: 7 UE8M0 bytes (one per
  64-dim tile, scale = 2**(byte - 127)), then one pad byte.

A block may be followed by padding: the block stride is read from the tensor, never assumed.
"""

import math

D_QK = 512  # query/key width: 448 nope + 64 rope
DEFAULT_SM_SCALE = D_QK ** -0.5  # the softmax scale when a caller gives none
LOG2_E = math.log2(math.e)  # the kernels' scores are in log2 units: s * sm_scale * LOG2_E
D_V = 512  # value width: the same latent
D_NOPE = 448
D_ROPE = 64
TILE = 64  # nope dims per UE8M0 scale
NUM_TILES = D_NOPE // TILE  # 7
ROW_BYTES = D_NOPE + 2 * D_ROPE  # 576: fp8 nope + bf16 rope of one token
SCALE_BYTES = 8  # 7 scales + 1 pad byte per token
TOKEN_BYTES = ROW_BYTES + SCALE_BYTES  # 584 logical bytes per token
BLOCK_STRIDE_ALIGN = 16  # block strides must keep 16-byte alignment for the row copies
UE8M0_BIAS = 127
FP8_E4M3_MAX = 448.0


def block_bytes(page_block_size: int) -> int:
    """Bytes a page block of ``page_block_size`` tokens uses (without trailing padding)."""
    return page_block_size * TOKEN_BYTES
