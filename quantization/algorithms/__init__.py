"""textgate.quantization.algorithms: RTN, GPTQ and AWQ on CPU, behind `textgate quantize`.

`quantization/gptq.py` and `quantization/awq.py` are the *loaders* of those checkpoint
formats; this package *makes* the checkpoints (`quantize_model`).
"""

from textgate.quantization.algorithms.quantize import (
    METHODS,
    QuantizeOptions,
    QuantizeReport,
    quantize_model,
)
from textgate.quantization.algorithms.rtn import QuantSpec

__all__ = ["METHODS", "QuantSpec", "QuantizeOptions", "QuantizeReport", "quantize_model"]
