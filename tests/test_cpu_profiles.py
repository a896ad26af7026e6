"""The CPU-dependent tests again, as slower CPUs run them: one machine checks every path.

Each profile makes this process behave like a CPU with fewer features, through switches
the libraries themselves read: `TEXTGATE_CPU_ISA` loads the C kernels built for a lower
level (kernels/cpu_isa.py), `ATEN_CPU_CAPABILITY` makes torch dispatch to its kernels for
that capability (whose int4 packing layout differs), `ONEDNN_MAX_CPU_ISA` caps oneDNN
(which then sums int8 products without VNNI and saturates). The kernel and quantization
tests then run in a child process under each profile this CPU can execute, except the one
the main run already is (the best level). docs/hardware.md lists the profiles.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from textgate.kernels import cpu_isa

ROOT = Path(__file__).resolve().parent.parent
#: Profile -> (level of the C kernels, torch's CPU capability, oneDNN's cap).
PROFILES = {
    "avx512": ("avx512", "avx512", "AVX512_CORE"),  # Skylake-SP: AVX512, no VNNI
    "avx2": ("avx2", "avx2", "AVX2"),  # Zen 1/2, Haswell..Comet Lake
    "portable": ("portable", "default", "SSE41"),
}
#: The tests whose numbers depend on the CPU's paths.
TESTS = (
    "tests/kernels/test_int8_linear.py",
    "tests/kernels/test_cpu_layers.py",
    "tests/kernels/test_cpu_attention.py",
    "tests/kernels/test_kv_quant.py",
    "tests/kernels/test_int4_layout.py",
    "tests/quantization/test_gptq.py",
    "tests/quantization/test_awq.py",
    "tests/quantization/test_int8.py",
    # The embedded model's Q4_1 linears against its folder's weights (the 4-bit GGUF path).
    "tests/quantization/test_gguf.py::test_gguf_model_keeps_its_linears_quantized_and_matches_the_folder",
)


def _profiles() -> list:
    best = cpu_isa.runnable_levels()[-1].name
    runnable = {level.name for level in cpu_isa.runnable_levels()}
    params = []
    for name, (level, *_) in PROFILES.items():
        reason = None
        if not cpu_isa.is_x86():
            reason = "x86 profiles"
        elif level not in runnable:
            reason = f"this CPU cannot run the {level} level"
        elif level == best:
            reason = f"{level} is this CPU's own level: the main run covers it"
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(name, marks=marks))
    return params


@pytest.mark.parametrize("profile", _profiles())
def test_cpu_dependent_tests_pass_as_a_slower_cpu(profile):
    level, capability, onednn = PROFILES[profile]
    env = {
        **os.environ,
        cpu_isa.ISA_ENV: level,
        "ATEN_CPU_CAPABILITY": capability,
        "ONEDNN_MAX_CPU_ISA": onednn,
    }
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS]
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert result.returncode == 0, f"under the {profile} profile:\n{result.stdout[-6000:]}"
