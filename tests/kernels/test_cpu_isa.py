"""Choosing the C kernels' instruction-set level from the CPU's features."""

from __future__ import annotations

import itertools

import pytest

from textgate.kernels import cpu_isa
from textgate.kernels.cpu_isa import X86_LEVELS, level_named, runnable_levels, select_level

ZEN1 = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
SKYLAKE_SP = ZEN1 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ICELAKE = SKYLAKE_SP | {"avx512_vnni"}


@pytest.fixture
def x86(monkeypatch):
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: True)


@pytest.mark.parametrize(
    ("cpu", "best"),
    [
        (frozenset({"sse2"}), "portable"),
        (ZEN1, "avx2"),
        (ZEN1 - {"fma"}, "portable"),  # AVX2 without FMA is not x86-64-v3
        (SKYLAKE_SP, "avx512"),
        (ICELAKE, "avx512-vnni"),
        (ICELAKE - {"avx512cd"}, "avx2"),
    ],
)
def test_the_best_level_is_the_highest_whose_features_the_cpu_has(x86, cpu, best):
    assert select_level(None, cpu).name == best
    assert runnable_levels(cpu)[0].name == "portable"


def test_levels_are_ordered_and_each_adds_to_the_one_before():
    for lower, higher in itertools.pairwise(X86_LEVELS):
        assert lower.features < higher.features


def test_the_environment_picks_a_lower_level(x86, monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert select_level(None, ICELAKE).name == "avx2"
    assert select_level("portable", ICELAKE).name == "portable"


def test_a_level_the_cpu_cannot_run_or_an_unknown_one_is_refused(x86):
    with pytest.raises(ValueError, match="lacks avx512_vnni"):
        select_level("avx512-vnni", SKYLAKE_SP)
    with pytest.raises(ValueError, match=r"unknown CPU kernel level 'amx'.*avx2"):
        level_named("amx")


def test_other_machines_have_a_portable_and_a_native_level(monkeypatch):
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: False)
    assert [lv.name for lv in runnable_levels(frozenset())] == ["portable", "native"]
    assert select_level(None, frozenset()).name == "native"


def test_bf16_arithmetic_is_read_from_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_features", lambda: ZEN1)
    assert not cpu_isa.has_bf16_arithmetic()
    monkeypatch.setattr(cpu_isa, "cpu_features", lambda: ICELAKE | {"avx512_bf16"})
    assert cpu_isa.has_bf16_arithmetic()
