"""The engines' call shapes and the plugins that put them in the engines.

One module per call shape an engine makes, each with its refusals (what it does not serve is
refused with an ``InvalidDecodeInput`` naming it, before any GPU work):

- ``flashmla``: FlashMLA's sparse FP8 decode, ``flash_mla_with_kvcache`` (the call vLLM's and
  SGLang's DeepSeek-V4 / V4.1 and V3.2 / GLM-5 attention makes on Hopper), and SGLang's SM120
  ``flash_mla_with_kvcache_sm120`` (FlashMLA's keyword names);
- ``flashinfer_dsv4``: FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4`` (vLLM's DeepSeek-V4
  / V4.1 call on SM120), every parameter of flashinfer-python 0.7.2 and 0.7.4 in their order;
- ``flashinfer_mla``: FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla`` in its sparse form
  (vLLM's DeepSeek-V3.2 / GLM-5 call on SM120, 656-byte rows).

The plugins (opt-in by ``DSV4_MLA_ENGINE_KERNELS``, ``plugin_mode``): ``vllm_plugin`` and
``sglang_plugin``, the entry points the engines load; ``sm90_route`` (on Hopper, each call to
this library or to the engine's own FlashMLA, by ``dispatch.policy.sm90_policy``); ``status``
(``dsv4-mla-engines``: what the plugins patch in this environment and what this GPU routes).

This wing sits above the public modules: nothing else in ``dispatch/`` imports it but the
self-test (``dispatch.tools``), which times the engines' calls.
"""
