"""The kernels: attention, LoRA, norms and linears, per backend (dispatch.py chooses)."""

from kernels import cpu_features

# Before any torch operation of the process: torch and oneDNN fix their instruction set then.
cpu_features.hold_to_isa()
