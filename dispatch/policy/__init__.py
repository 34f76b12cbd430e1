"""How a call is served: its metadata, compute path, head groups, split and kernel variants, and
the deployment registry the AOT build compiles (no torch work, no GPU)."""
