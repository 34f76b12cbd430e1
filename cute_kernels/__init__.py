"""CuTe DSL kernels for DeepSeek-V4 sparse MLA decode on SM120, Ampere and Ada (sm_80, sm_86,
sm_89), and SM90 for testing (``arch``: what each target has).

Nothing here is imported eagerly: ``cute_kernels.sparse_mla_decode.reference`` and
the cache views, writers and readers (``cache_view``, ``cache_writers``, ``cache_readers``) are
plain torch and load without the CUTLASS DSL.
"""
