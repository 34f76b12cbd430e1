"""Sparse MLA decode: the cache formats, the float64 reference and the kernels.

Plain Python or torch, no CUTLASS (import them on any machine):
- ``kv_format``: each cache format as data (DeepSeek-V4's MODEL1 FP8 and NVFP4 records,
  DeepSeek-V4.1's 528- and 288-byte records, DeepSeek-V3.2 / GLM-5's 656-byte rows, GLM-5.3's
  rope-free rows): the facts every reader takes;
- ``cache_view``: which tensor views of a cache are read, as which format, and how an index
  addresses its bytes; ``cache_writers``: each engine's writer (quantize, pack);
  ``cache_readers``: the stored values of slots, a cache unpacked; ``e2m1``: the FP4 element;
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
