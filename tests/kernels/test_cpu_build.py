"""Building and loading the C kernels: cache keys, errors, one OpenMP runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from textgate.kernels import cpu_build
from textgate.kernels.cpu_build import KernelBuildError, build_library, compiler, load_library
from textgate.kernels.cpu_layers import silu_and_mul


def test_a_compiler_is_here_and_the_kernel_builds():
    # CI machines and the Docker image have gcc: there the kernel, not SDPA, must run.
    assert compiler() is not None
    assert load_library() is not None


def test_build_errors_carry_the_command(tmp_path):
    with pytest.raises(KernelBuildError, match=r"false .*-c .*cpu_\w+\.c"):
        build_library(tmp_path, "false")


def test_a_build_is_reused_until_source_compiler_or_cpu_change(tmp_path, monkeypatch):
    cc = compiler()
    assert cc is not None
    first = build_library(tmp_path, cc)
    built_at = first.stat().st_mtime_ns
    assert build_library(tmp_path, cc) == first
    assert first.stat().st_mtime_ns == built_at
    monkeypatch.setattr(cpu_build, "_cpu_signature", lambda: "flags : another cpu")
    other = build_library(tmp_path, cc)
    assert other != first and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_kernel_shares_torchs_openmp_runtime():
    # Two OpenMP runtimes would mean two thread pools spinning against each other.
    assert silu_and_mul(torch.randn(64, 32)) is not None
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes


def test_the_environment_can_turn_the_kernels_off(monkeypatch, fresh_library):
    monkeypatch.setenv("TEXTGATE_CPU_KERNELS", "0")
    assert load_library() is None
    assert silu_and_mul(torch.randn(4, 8)) is None
