"""Device helpers shared by the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def dot(a, b, UPCAST: tl.constexpr):  # type: ignore[no-untyped-def]  # triton reads annotations
    """a @ b accumulated in float32 (float32 inputs exactly: no tf32).

    UPCAST: multiply in float32 whatever the inputs. The launchers set it off the GPU,
    because triton 3.7's interpreter multiplies bfloat16 tiles as their raw uint16 bits;
    on the GPU half-precision tiles go to the tensor cores as they are.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")
