"""What the CPU kernels run on here: the CPU's features and the path each method takes.

Every choice below is made at runtime from what the running CPU and the installed torch do
(docs/hardware.md): the C kernels' instruction-set level (kernels/cpu_isa.py), the int8
layers' kernel (kernels/int8_linear.py), the layout torch packs int4 codes in
(kernels/int4_linear.py). The shard reports them in `/info` (`cpu_kernels`) and logs
them at startup.
"""

from __future__ import annotations

import platform
from functools import cache

import torch

from textgate.kernels import cpu_build, cpu_isa, int4_linear, int8_linear

#: The CPU flags that decide a path somewhere (the rest of /proc/cpuinfo is left out).
RELEVANT_FEATURES = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def cpu_kernel_report() -> dict[str, str]:
    """Name -> value of every runtime CPU choice, for /info and the startup log."""
    cpu = cpu_isa.cpu_features()
    layout = int4_linear.torch_int4_layout()
    expands = cpu_build.load_library() is not None and layout is not None
    return {
        "cpu": _cpu_name(),
        "cpu_features": " ".join(f for f in RELEVANT_FEATURES if f in cpu) or "none seen",
        "kernel_isa": cpu_build.loaded_level() or "off (PyTorch references)",
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "bf16_arithmetic": "yes" if cpu_isa.has_bf16_arithmetic() else "no",
        "int8_kernel": int8_linear.describe_kernel(),
        "onednn_int8_exact": "yes" if int8_linear.onednn_is_exact() else "no",
        "int4_layout": layout.name if layout is not None else "unknown",
        "int4_prompt_expansion": "on" if expands else "off (torch's int4 kernel)",
    }


def report_line() -> str:
    """`cpu_kernel_report` as one log line."""
    return "CPU kernels: " + ", ".join(f"{k}={v}" for k, v in cpu_kernel_report().items())
