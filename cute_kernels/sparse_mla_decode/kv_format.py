"""Sparse-MLA KV-cache formats as data: one description per format, the facts every reader uses.

A token's record holds its latent: ``nope_dims`` quantized values (``element``: e4m3, a byte
each, or e2m1, two to a byte with element 2i in the low nibble of byte i) with one scale per
``scale_group`` of them, then (optionally) ``rope_dims`` bf16 values stored as they are.
Where the scales sit:

- ``"footer"``: per page block of P tokens, the P data rows ``[nope | rope]`` first, packed at
  ``row_bytes``, then a footer of P scale records (``scale_bytes`` + ``footer_pad`` bytes each)
  at ``P * row_bytes + t * footer_bytes``;
- ``"inline"``: each token's row is ``[nope | scales | rope]``; rows are ``row_stride`` bytes
  apart inside a page block (a runtime value, at least ``row_bytes``; bytes past ``row_bytes``
  are never read).

How an index finds its row: paged (most formats), slot s in page block s // P at
offset s % P; or, for ``flat_rows`` formats (DeepSeek-V4.1's inline records, as FlashInfer's
reader and writers address them), index r names row r of the whole cache viewed as rows
``row_stride`` apart: block r // R, row r % R, with R = block_stride / row_stride rows per
block (the block stride a whole number of rows). The two agree when blocks carry no padding
(block_stride == P * row_stride); b12x's V4.1 writer and reader use paged addressing
(``(s // P) * block_stride + (s % P) * row_stride``), which differs from FlashInfer's for
padded blocks. The kernels see one addressing: flat rows are paged rows with P = R
(``cache_view.CacheView.index_page``).

The cache validation, packers, unpacker, reference, the kernels' gather and dequantization,
the variant key, the AOT registry and the error messages all take their facts from here; the
kernels get them as compile-time constants. Plain Python: no torch, no CUTLASS.
"""

from __future__ import annotations

from dataclasses import dataclass

UE8M0_BIAS = 127
FP8_E4M3_MAX = 448.0
FLT_MIN = 2.0**-126  # the smallest normal float32
NOPE_TILE = 64  # nope dims per "f16" nope warp and per FP8-path MMA unit
D_V = 512  # every format's value width: the output rows and the merge kernel's
PRECISIONS = ("bf16", "f16", "fp8", "mxf8")  # the compute paths (``docs/design.md``, "Precision")


@dataclass(frozen=True)
class KvFormat:
    """One cache format (module docstring). ``model_type`` starts every refusal message of a
    call on such a cache; ``row_pitches``: the inline row strides a 2-D (flat) view may
    imply, the first the default.

    What the library serves of it is declared here and read everywhere else (validation, the
    variant space, the AOT registry, the adapters, the self-test): ``extras``, the formats an
    extra (compressed) cache beside a main cache of this one may have (the model's
    combinations; none: no extra cache); ``main``, whether it is read as a main cache at all
    (False: only as an extra); and, from its layout, ``paths``, the compute paths whose kernels
    read it (``path_problem``)."""

    name: str
    model_type: str
    nope_dims: int
    rope_dims: int
    rope_in_v: bool
    # "ue8m0": one byte b, 2**(b - 127); "fp32": a little-endian float32; "e4m3": one e4m3 byte
    scale_type: str
    scale_group: int
    scale_placement: str  # "footer" | "inline"
    extras: tuple[str, ...] = ()
    main: bool = True
    footer_pad: int = 0
    row_pitches: tuple[int, ...] = ()
    element: str = "e4m3"  # the nope values: "e4m3" (a byte each) | "e2m1" (two to a byte)
    flat_rows: bool = False  # inline only: an index is a row of the whole cache (module docstring)

    @property
    def e2m1(self) -> bool:
        return self.element == "e2m1"

    @property
    def paths(self) -> tuple[str, ...]:
        """The compute paths whose kernels read this format, in ``PRECISIONS`` order."""
        return tuple(p for p in PRECISIONS if path_problem(p, self) is None)

    @property
    def fp32_scales(self) -> bool:
        return self.scale_type == "fp32"

    @property
    def nope_bytes(self) -> int:
        """Bytes of a row's nope values."""
        return self.nope_dims // 2 if self.e2m1 else self.nope_dims

    @property
    def tile_bytes(self) -> int:
        """Bytes of one 64-dim nope tile in a row."""
        return self.nope_bytes // self.nope_tiles

    @property
    def d_qk(self) -> int:
        return self.nope_dims + self.rope_dims

    @property
    def d_v(self) -> int:
        return self.nope_dims + (self.rope_dims if self.rope_in_v else 0)

    @property
    def default_sm_scale(self) -> float:
        """The softmax scale when a caller gives none: d_qk ** -0.5 (FlashMLA's)."""
        return self.d_qk ** -0.5

    @property
    def tile_scales(self) -> int:
        """Scale groups per 64-dim nope tile (the scales one "f16" nope warp applies)."""
        return max(1, NOPE_TILE // self.scale_group)

    @property
    def num_scales(self) -> int:
        return self.nope_dims // self.scale_group

    @property
    def scale_bytes(self) -> int:
        return self.num_scales * (4 if self.fp32_scales else 1)

    @property
    def view_widths(self) -> tuple[int, ...]:
        """The last dimensions a 4-D view of such a cache may have: a footer format's bytes
        per token; an inline format's row bytes and row pitches (``cache_view``)."""
        if not self.inline:
            return (self.bytes_per_token,)
        return tuple(sorted({self.row_bytes, *self.row_pitches}))

    @property
    def inline(self) -> bool:
        return self.scale_placement == "inline"

    @property
    def nope_tiles(self) -> int:
        """64-dim nope tiles: the "f16" kernel's nope warps."""
        return self.nope_dims // NOPE_TILE

    @property
    def raw_row_stride(self) -> int:
        """Shared-memory bytes per gathered row: the row padded to an odd number of 16-byte
        units, so that 8 consecutive rows start on different banks (conflict-free ldmatrix
        on the raw rows); MODEL1's 576 becomes 592."""
        units = -(-self.row_bytes // 16)
        return 16 * (units + 1 - units % 2)

    @property
    def rope_offset(self) -> int:
        """Byte offset of the rope dims in a row."""
        return self.nope_bytes + (self.scale_bytes if self.inline else 0)

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scales in a row (inline) or in a footer record (footer)."""
        return self.nope_bytes if self.inline else 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row as the kernels read it."""
        return self.rope_offset + 2 * self.rope_dims

    @property
    def footer_bytes(self) -> int:
        """Bytes of one token's footer record (0 for inline scales)."""
        return 0 if self.inline else self.scale_bytes + self.footer_pad

    @property
    def bytes_per_token(self) -> int:
        """Logical bytes per token: the row and its footer record."""
        return self.row_bytes + self.footer_bytes

    def __post_init__(self):
        # what the kernels read: e4m3 values with a UE8M0 scale per 64 or 32 dims or an FP32
        # scale per 128; e2m1 values with an E4M3 scale per 16 (NVFP4); footer records read by
        # whole 16-byte pieces (or MODEL1's one 8-byte piece)
        kinds = {("e4m3", "ue8m0"): (NOPE_TILE, NOPE_TILE // 2), ("e4m3", "fp32"): (2 * NOPE_TILE,),
                 ("e2m1", "e4m3"): (16,)}
        if self.nope_dims % NOPE_TILE or self.nope_dims % self.scale_group:
            raise ValueError(f"{self.name}: nope dims must be a multiple of {NOPE_TILE} and of the scale group")
        if (self.scale_group not in kinds.get((self.element, self.scale_type), ())
                or self.scale_placement not in ("footer", "inline")):
            raise ValueError(f"{self.name}: the kernels read {kinds} (element, scale type): groups, in a footer "
                             f"or inline")
        if self.footer_bytes not in (0, 8) and self.footer_bytes % 16:
            raise ValueError(f"{self.name}: footer records are 8 bytes or whole 16-byte pieces")
        if self.flat_rows and not self.inline:
            raise ValueError(f"{self.name}: flat-row addressing is for inline records")
        if self.inline and self.scale_offset % 4:
            raise ValueError(f"{self.name}: inline scales start 4-byte aligned in the row")
        if self.d_v != D_V or self.rope_dims % 16:
            raise ValueError(f"{self.name}: the kernels take {D_V} value dims and rope dims in k16 steps")


MODEL1_FP8 = KvFormat(
    name="model1_fp8", model_type="DeepSeek-V4 sparse MLA decode (MODEL1 FP8 cache, 584 B per token)",
    nope_dims=448, rope_dims=64, rope_in_v=True, scale_type="ue8m0", scale_group=64, scale_placement="footer",
    extras=("model1_fp8", "model1_nvfp4"), footer_pad=1,
)
V32_FP8 = KvFormat(
    name="v32_fp8", model_type="DeepSeek-V3.2 / GLM-5 sparse MLA decode (656 B FP8 rows, FP32 scales)",
    nope_dims=512, rope_dims=64, rope_in_v=False, scale_type="fp32", scale_group=128, scale_placement="inline",
    row_pitches=(656,),
)
MODEL1_NVFP4 = KvFormat(
    name="model1_nvfp4", model_type="DeepSeek-V4 sparse MLA decode (NVFP4 cache, 384 B per token)",
    nope_dims=448, rope_dims=64, rope_in_v=True, scale_type="e4m3", scale_group=16, scale_placement="footer",
    extras=("model1_nvfp4", "model1_fp8"), footer_pad=4, element="e2m1",
)
GLM_NOPE_FP8 = KvFormat(
    name="glm_nope_fp8", model_type="GLM-5.3 sparse MLA decode (528 B rope-free FP8 rows, FP32 scales)",
    nope_dims=512, rope_dims=0, rope_in_v=False, scale_type="fp32", scale_group=128, scale_placement="inline",
    row_pitches=(528, 656),
)

V41_FP8 = KvFormat(
    name="v41_fp8", model_type="DeepSeek-V4.1 sparse MLA decode (528 B FP8 rows, footer UE8M0 scales per 32)",
    nope_dims=512, rope_dims=0, rope_in_v=False, scale_type="ue8m0", scale_group=32, scale_placement="footer",
    extras=("v41_fp8", "v41_nvfp4"),
)
V41_FP8_INLINE = KvFormat(
    name="v41_fp8_inline", model_type="DeepSeek-V4.1 sparse MLA decode (528 B FP8 records, inline UE8M0 per 32)",
    nope_dims=512, rope_dims=0, rope_in_v=False, scale_type="ue8m0", scale_group=32, scale_placement="inline",
    extras=("v41_fp8_inline", "v41_nvfp4_inline"), row_pitches=(528,), flat_rows=True,
)
V41_NVFP4 = KvFormat(
    name="v41_nvfp4", model_type="DeepSeek-V4.1 sparse MLA decode (288 B NVFP4 extra rows, footer E4M3 scales)",
    nope_dims=512, rope_dims=0, rope_in_v=False, scale_type="e4m3", scale_group=16, scale_placement="footer",
    main=False, element="e2m1",
)
V41_NVFP4_INLINE = KvFormat(
    name="v41_nvfp4_inline", model_type="DeepSeek-V4.1 sparse MLA decode (288 B NVFP4 extra records, inline "
    "E4M3 scales)", nope_dims=512, rope_dims=0, rope_in_v=False, scale_type="e4m3", scale_group=16,
    scale_placement="inline", main=False, row_pitches=(288,), flat_rows=True, element="e2m1",
)

FORMATS = {f.name: f for f in (MODEL1_FP8, MODEL1_NVFP4, V32_FP8, GLM_NOPE_FP8, V41_FP8, V41_FP8_INLINE, V41_NVFP4,
                               V41_NVFP4_INLINE)}
DEFAULT_FORMAT = MODEL1_FP8.name
# the format a cache of this last-dimension width is read as unless ``kv_format`` names one:
# 584 is MODEL1's alone; 656 is V3.2's row and also a GLM-5.3 pool pitch (vLLM keeps GLM-5.3
# rows in 656-byte pool rows), read as V3.2 unless named; 384 is MODEL1 NVFP4's alone; a
# 528-byte row (GLM-5.3, V4.1 FP8) and a 288-byte one (V4.1 NVFP4) must be named
FORMAT_BY_WIDTH = {MODEL1_FP8.bytes_per_token: MODEL1_FP8.name, MODEL1_NVFP4.bytes_per_token: MODEL1_NVFP4.name,
                   V32_FP8.row_bytes: V32_FP8.name}
# The pairings as the formats declare them (``KvFormat.extras``), as one table. The models'
# combinations: DeepSeek-V4, its FP8 or NVFP4 record for either cache (a deployment may keep
# the compressed cache in the smaller record, or the sliding window); DeepSeek-V4.1, an FP8
# sliding-window cache with an FP8 or NVFP4 compressed cache, both with the same scale
# placement (FlashInfer's footer route, or FlashMLA's V4.1 inline records). The extra cache's
# format: ``cache_view.extra_format_of``.
EXTRA_FORMATS = {f.name: f.extras for f in FORMATS.values() if f.extras}


def path_problem(path: str, fmt: KvFormat) -> str | None:
    """Why the kernel of compute path ``path`` cannot read ``fmt``'s caches, None where it can:
    e2m1 values (NVFP4) only "f16" (value times scale becomes an exact f16 operand in
    registers); the FP8 paths take UE8M0 scales one per 64-dim MMA unit (not per 32, V4.1);
    "mxf8" only UE8M0 scales (the block-scaled MMA takes the scale bytes themselves). A
    format's ``paths`` are those with none."""
    if path not in PRECISIONS:
        return f"precision {path!r} is not one of {PRECISIONS}"
    if fmt.e2m1 and path != "f16":
        return "e2m1 values are read by the \"f16\" path only"
    if path in ("fp8", "mxf8") and fmt.scale_type == "ue8m0" and fmt.scale_group != NOPE_TILE:
        return f"the FP8 paths apply one UE8M0 scale per {NOPE_TILE}-dim MMA unit, not per {fmt.scale_group} dims"
    if path == "mxf8" and fmt.scale_type != "ue8m0":
        return f"the block-scaled MMA takes UE8M0 scale bytes, not {fmt.scale_type} scales"
    return None


def path_refusal(path: str, fmt: KvFormat) -> str | None:
    """``path_problem`` as the sentence every refusal of that pairing says, or None."""
    problem = path_problem(path, fmt)
    return None if problem is None else f"precision {path!r} does not read {fmt.name} caches ({problem})"


def get_format(name: str) -> KvFormat:
    """The description of ``name``; ValueError naming the known formats otherwise."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"kv_format must be one of {sorted(FORMATS)}, got {name!r}") from None


def formats_of_width(width: int) -> list[str]:
    """The formats whose cache views may have a last dimension of ``width`` bytes."""
    return sorted(f.name for f in FORMATS.values() if width in f.view_widths)
