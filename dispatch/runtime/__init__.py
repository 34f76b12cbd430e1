"""Running a call: its tensors as one record, plans and their launches, the one-shot plan
cache, the loader of compiled kernels and its fingerprints, the lse conventions."""
