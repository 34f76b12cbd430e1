"""The console commands (``dsv4-mla-aot-build``, ``dsv4-mla-check-aot``, ``dsv4-mla-selftest``)
and what they share with the tests and benchmarks: sample inputs, accuracy bounds, timing."""
