"""Triton kernels for the CUDA path, one op per file, each a kernel and a thin launcher that
checks shapes, dtypes and strides. Imported only through `kernels.dispatch`, which decides
(once, before the first `@triton.jit` runs) whether they compile for the GPU or run under
the interpreter (TRITON_INTERPRET=1) on the CPU for tests. The torch versions in
`kernels/attention.py`, `kernels/lora.py` and the engine's norm and rotary are the
specification every kernel here is tested against."""
