"""Sparse MLA decode: the DSV4 FP8 cache format, the float64 reference and the kernels.

Plain torch, no CUTLASS (import them on any machine):
- ``layout``: the numbers of the DSV4 "MODEL1" FP8 cache layout;
- ``cache_format``: pack / unpack a bf16 latent to / from that layout, read cache views;
- ``reference``: the oracle of the decode semantics; ``fp8_model``: the FP8 path's rounding;
- ``config``, ``smem``, ``tuning``, ``kernel_args``: the kernels' compile-time configuration,
  shared-memory plans, tuning constants and argument schema.

CuTe DSL (``docs/design.md``):
- ``partial``: the split-K partial kernel's launch and shared parts; its compute paths
  ``partial_f16`` (the default), ``partial_bf16``, ``partial_fp8`` ("fp8", "mxf8");
- ``gather``, ``softmax``, ``epilogue``: the pieces every path calls;
- ``merge``: the lse-weighted combine kernel; ``warp_ops``, ``device_utils``: inline PTX and
  small device helpers.
"""
