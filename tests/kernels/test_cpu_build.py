"""Building and loading the C kernels: cache keys, errors, one OpenMP runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from textgate.kernels import cpu_build, cpu_isa
from textgate.kernels.cpu_build import (
    KernelBuildError,
    build_library,
    compiler,
    load_kernels,
    load_library,
    loaded_level,
)
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


def test_each_level_the_cpu_runs_builds_its_own_library(tmp_path):
    cc = compiler()
    assert cc is not None
    built = {level.name: build_library(tmp_path, cc, level) for level in cpu_isa.runnable_levels()}
    assert len(set(built.values())) == len(built)
    assert all(path.name.startswith(f"textgate_cpu-{name}-") for name, path in built.items())


def test_the_best_level_loads_unless_the_environment_names_one(monkeypatch, fresh_library):
    assert loaded_level() == cpu_isa.runnable_levels()[-1].name
    load_kernels.cache_clear()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "portable")
    assert loaded_level() == "portable"
    assert load_library().textgate_int8_isa() == 0


def test_a_level_that_fails_to_build_falls_back_to_the_one_below(monkeypatch, fresh_library):
    runnable = cpu_isa.runnable_levels()
    if len(runnable) < 2:
        pytest.skip("this CPU runs one level only")
    real_build = cpu_build.build_library

    def build(build_dir, cc, level=None):
        if level == runnable[-1]:
            raise KernelBuildError(f"{cc} does not know {level.flags}")
        return real_build(build_dir, cc, level)

    monkeypatch.setattr(cpu_build, "build_library", build)
    assert loaded_level() == runnable[-2].name


def test_a_level_the_cpu_cannot_run_is_not_loaded(monkeypatch, fresh_library, caplog):
    unrunnable = [lv for lv in cpu_isa.levels() if lv not in cpu_isa.runnable_levels()]
    if not unrunnable:
        pytest.skip("this CPU runs every level")
    monkeypatch.setenv(cpu_isa.ISA_ENV, unrunnable[0].name)
    assert loaded_level() == cpu_isa.runnable_levels()[-1].name
    assert "cannot run that level" in caplog.text
