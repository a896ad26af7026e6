"""The instruction-set levels the C kernels are built for, and the one this CPU runs.

Each level is one build of the kernels (kernels/cpu_build.py) with its own compiler flags.
The C sources pick their code paths at compile time from the macros those flags define
(`__AVX2__`, `__AVX512VNNI__`, ...), so a level's build runs the same paths on every CPU
that has the level's features, whatever machine it was compiled on. At startup the best
level the running CPU has is chosen (`select_level`), or the one `TEXTGATE_CPU_ISA` names;
the kernel tests build every level the machine can execute (`runnable_levels`), so one
machine checks the paths a slower CPU takes as well.

Levels on x86-64, each adding to the one before (the psABI's micro-architecture levels):
- `portable`: x86-64 baseline (SSE2); plain C everywhere.
- `avx2`: x86-64-v3 (AVX2, FMA, F16C, BMI): int8 layers on an int16-exact AVX2 kernel.
- `avx512`: x86-64-v4 (AVX512 F/BW/CD/DQ/VL).
- `avx512-vnni`: x86-64-v4 with AVX512-VNNI: int8 layers on `vpdpbusd`.
Elsewhere (aarch64, ...) there are two: `portable` (the compiler's default target) and
`native` (`-march=native`).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache

ISA_ENV = "TEXTGATE_CPU_ISA"
"""Environment variable naming the level to load instead of the best one the CPU runs."""


@dataclass(frozen=True)
class IsaLevel:
    """One build of the C kernels: its name, its compiler flags, the CPU features it needs."""

    name: str
    flags: tuple[str, ...]
    features: frozenset[str]
    """Flags of /proc/cpuinfo a CPU must show to run this build."""

    def runs_on(self, cpu: frozenset[str]) -> bool:
        return self.features <= cpu


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# -mtune=native only schedules instructions for this CPU; it never adds any.
X86_LEVELS = (
    IsaLevel("portable", ("-march=x86-64", "-mtune=generic"), frozenset()),
    IsaLevel("avx2", ("-march=x86-64-v3", "-mtune=native"), _V3),
    IsaLevel("avx512", ("-march=x86-64-v4", "-mtune=native"), _V4),
    IsaLevel(
        "avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=native"), _V4 | {"avx512_vnni"}
    ),
)
OTHER_LEVELS = (
    IsaLevel("portable", (), frozenset()),
    IsaLevel("native", ("-march=native",), frozenset()),
)


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def levels() -> tuple[IsaLevel, ...]:
    """This machine architecture's levels, slowest first."""
    return X86_LEVELS if is_x86() else OTHER_LEVELS


@cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16_arithmetic() -> bool:
    """Whether the CPU computes in bfloat16 natively (AVX512-BF16, AMX-BF16; Arm's BF16).
    Without it every bf16 value is converted to compute, so `--dtype auto` takes bf16 only
    where it measured faster."""
    return bool(cpu_features() & {"avx512_bf16", "amx_bf16", "bf16"})


def runnable_levels(cpu: frozenset[str] | None = None) -> tuple[IsaLevel, ...]:
    """The levels whose builds run on `cpu` (default: this CPU), slowest first. Where the
    features cannot be read on x86, only `portable`."""
    cpu = cpu_features() if cpu is None else cpu
    return tuple(level for level in levels() if level.runs_on(cpu))


def level_named(name: str) -> IsaLevel:
    """The level called `name`; ValueError naming the known ones otherwise."""
    for level in levels():
        if level.name == name:
            return level
    known = ", ".join(level.name for level in levels())
    raise ValueError(f"unknown CPU kernel level {name!r} ({ISA_ENV}); known here: {known}")


def select_level(requested: str | None = None, cpu: frozenset[str] | None = None) -> IsaLevel:
    """The level to load: `requested` (default `$TEXTGATE_CPU_ISA`) when this CPU runs it,
    else the best one it runs. A name the CPU cannot run raises ValueError, as does an
    unknown one: running it would stop the process with an illegal instruction."""
    if requested is None:
        requested = os.environ.get(ISA_ENV) or None
    runnable = runnable_levels(cpu)
    if requested is None:
        return runnable[-1]
    level = level_named(requested)
    if level not in runnable:
        missing = " ".join(sorted(level.features - (cpu_features() if cpu is None else cpu)))
        raise ValueError(
            f"{ISA_ENV}={requested}: this CPU cannot run that level's kernels (it lacks {missing})"
        )
    return level
