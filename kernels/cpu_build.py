"""Builds and loads the C kernels of this package (cpu_*.c) as one shared library.

The library is compiled on first use with the machine's C compiler (`$CC`, else `cc`) for
one instruction-set level (kernels/cpu_isa.py: the best this CPU runs, or
`$TEXTGATE_CPU_ISA`), into `$TEXTGATE_CACHE/kernels`, and reused after; the build is keyed
by the sources, the level's flags, the compiler's version and the CPU's features. A level
the compiler cannot build falls back to the next one below it. Its functions run
on torch's OpenMP threads: the library is loaded after torch, which already holds
libgomp.so.1, so both use one runtime and one thread count (torch.set_num_threads).
Where it cannot be built, or with `TEXTGATE_CPU_KERNELS=0` in the environment, `load_library()`
is None and every caller runs its PyTorch reference instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from textgate.kernels import cpu_isa
from textgate.kernels.cpu_isa import IsaLevel
from textgate.paths import cache_dir

log = logging.getLogger("textgate.kernels")

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_attention.c",
        "cpu_layers.c",
        "cpu_int8.c",
        "cpu_int4.c",
        "cpu_decoder.c",
        "cpu_lora.c",
        "cpu_dense.c",
    )
)
HEADERS = (Path(__file__).with_name("cpu_bf16.h"),)
"""Included by the sources: part of the build's key."""
# -ffast-math lets the compiler vectorize expf and the float sums. It is given to
# the compile step only: linking with it adds crtfastmath.o, whose constructor would put
# the whole process into flush-denormals-to-zero mode.
# The target (-march) comes from the level being built (cpu_isa).
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled here."""


def compiler() -> str | None:
    """The C compiler to build with: `$CC`, else `cc` or `gcc` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """What -mtune=native depends on: the CPU's feature flags (Linux), else its name."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_library(build_dir: Path, cc: str, level: IsaLevel | None = None) -> Path:
    """Compile the kernels for `level` (default: the best this CPU runs) into `build_dir`
    unless a build for these sources, level, compiler and CPU is there already; returns the
    shared library's path."""
    level = level or cpu_isa.select_level()
    flags = (*COMPILE_FLAGS, *level.flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    key.update(" ".join(flags + LINK_FLAGS).encode())
    key.update(version.stdout.encode())
    key.update(_cpu_signature().encode())
    library = build_dir / f"textgate_cpu-{level.name}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        out = Path(tmp) / library.name
        commands = [
            [cc, *flags, "-c", str(source), "-o", obj]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        commands.append([cc, *LINK_FLAGS, "-o", str(out), *objects, "-lm"])
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise KernelBuildError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        # Atomic: a concurrent build (another shard) writes the same bytes.
        os.replace(out, library)
    return library


def load_library(build_dir: Path | None = None, level: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels for `level` (default: `cpu_isa.select_level()`), built on first
    use; None (logged once) where they cannot be."""
    loaded = load_kernels(build_dir, level)
    return None if loaded is None else loaded[0]


def loaded_level() -> str | None:
    """The level `load_library()` runs, or None where the kernels are off or unavailable."""
    loaded = load_kernels()
    return None if loaded is None else loaded[1].name


@functools.cache
def load_kernels(
    build_dir: Path | None = None, level: str | None = None
) -> tuple[ctypes.CDLL, IsaLevel] | None:
    """`load_library` with the level it loaded: the one asked for, or a lower one where the
    compiler cannot build it."""
    if os.environ.get("TEXTGATE_CPU_KERNELS", "1") == "0":
        log.info("TEXTGATE_CPU_KERNELS=0: CPU kernels run their PyTorch references")
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found ($CC, cc, gcc): CPU kernels run their PyTorch references")
        return None
    try:
        wanted = cpu_isa.select_level(level)
    except ValueError as exc:
        wanted = cpu_isa.runnable_levels()[-1]
        log.warning("%s; loading %s, the best level this CPU runs", exc, wanted.name)
    runnable = cpu_isa.runnable_levels()
    for candidate in reversed(runnable[: runnable.index(wanted) + 1]):
        try:
            path = build_library(build_dir or cache_dir() / "kernels", cc, candidate)
            # torch first: the kernel's libgomp.so.1 must resolve to the runtime torch loaded.
            library = ctypes.CDLL(str(path))
        except (KernelBuildError, OSError) as exc:
            log.warning("CPU kernels for %s unavailable: %s", candidate.name, exc)
            continue
        if candidate != wanted:
            log.warning("CPU kernels built for %s instead of %s", candidate.name, wanted.name)
        _declare(library)
        return library, candidate
    log.warning("CPU kernels unavailable: running their PyTorch references")
    return None


def _declare(library: ctypes.CDLL) -> None:
    """Set the argument and return types of every function the library exports."""
    pointer, int64, flag, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "textgate_paged_attention": (
            ctypes.c_int,
            [*[pointer] * 8, *[int64] * 7, real, int64, flag, pointer, pointer, flag],
        ),
        "textgate_store_kv_quantized": (None, [*[pointer] * 4, *[int64] * 3, flag, flag]),
        "textgate_add_rms_norm": (None, [*[pointer] * 5, int64, int64, real, flag]),
        "textgate_silu_and_mul": (None, [pointer, pointer, int64, int64, flag]),
        "textgate_rotary_and_store": (None, [*[pointer] * 7, *[int64] * 4, flag]),
        "textgate_quantize_rows": (None, [*[pointer] * 3, int64, int64, flag]),
        "textgate_int8_isa": (ctypes.c_int, []),
        "textgate_int4_dequantize": (None, [pointer, pointer, *[int64] * 4, flag, pointer]),
        "textgate_decoder_layers": (
            ctypes.c_int,
            [pointer, pointer, int64, pointer, pointer, flag],
        ),
        # x, out, rows, in, width, row_slot, a, c_total, b, b_block, parts, num_parts, low, bf16
        "textgate_lora_add": (
            None,
            [
                *[pointer] * 2,
                *[int64] * 3,
                *[pointer] * 2,
                int64,
                pointer,
                int64,
                pointer,
                int64,
                pointer,
                flag,
            ],
        ),
        "textgate_dense_isa": (ctypes.c_int, []),
        "textgate_dense_bf16_dot": (ctypes.c_int, []),
        # x, rows, in, ldx, packed, bias, out, out_features, bf16
        "textgate_dense_linear": (None, [pointer, *[int64] * 3, *[pointer] * 3, int64, flag]),
        "textgate_int8_linear": (
            ctypes.c_int,
            [pointer, int64, int64, flag, *[pointer] * 6, int64, flag],
        ),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
