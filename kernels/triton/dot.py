"""The matmul every Triton program here shares: `tl.dot` with float32 accumulation.

The module imports triton; the programs' modules import it, loaded on first use only.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation. UPCAST: multiply in float32, exactly (the
    interpreter's bfloat16 dot is wrong; float32 operands want IEEE, not tf32)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out
