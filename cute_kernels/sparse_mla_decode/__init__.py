"""Sparse MLA decode: the DSV4 FP8 cache format, the float32 reference and the kernels.

- ``layout``: the numbers of the DSV4 "MODEL1" FP8 cache layout (no torch, no cutlass).
- ``cache_format``: pack/unpack a bf16 latent to/from that layout and read cache views (torch).
- ``reference``: the float32 oracle of the decode semantics (torch).
- ``config``: the compile-time configuration of the kernels and its constraint check.
- ``partial``: the split-K partial kernel (CuTe DSL).
- ``merge``: the lse-weighted combine kernel (CuTe DSL).
"""
