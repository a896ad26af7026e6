"""Builds and loads the C kernels of this package (cpu_*.c) as one shared library.

The library is compiled on first use with the machine's C compiler (`$CC`, else `cc`) for
the CPU it runs on, into `$TEXTGATE_CACHE/kernels`, and reused after; the build is keyed by
the sources, the flags, the compiler's version and the CPU's features. Its functions run
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

from textgate.paths import cache_dir

log = logging.getLogger("textgate.kernels")

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_attention.c", "cpu_layers.c", "cpu_int8.c", "cpu_int4.c")
)
HEADERS = (Path(__file__).with_name("cpu_bf16.h"),)
"""Included by the sources: part of the build's key."""
# -ffast-math lets the compiler vectorize expf and the float sums. It is given to
# the compile step only: linking with it adds crtfastmath.o, whose constructor would put
# the whole process into flush-denormals-to-zero mode.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled here."""


def compiler() -> str | None:
    """The C compiler to build with: `$CC`, else `cc` or `gcc` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else its name."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_library(build_dir: Path, cc: str) -> Path:
    """Compile the kernels into `build_dir` unless a build for these sources, compiler and
    CPU is there already; returns the shared library's path."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    key.update(" ".join(COMPILE_FLAGS + LINK_FLAGS).encode())
    key.update(version.stdout.encode())
    key.update(_cpu_signature().encode())
    library = build_dir / f"textgate_cpu-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        out = Path(tmp) / library.name
        commands = [
            [cc, *COMPILE_FLAGS, "-c", str(source), "-o", obj]
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


@functools.cache
def load_library(build_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (logged once) where they cannot be."""
    if os.environ.get("TEXTGATE_CPU_KERNELS", "1") == "0":
        log.info("TEXTGATE_CPU_KERNELS=0: CPU kernels run their PyTorch references")
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found ($CC, cc, gcc): CPU kernels run their PyTorch references")
        return None
    try:
        # torch first: the kernel's libgomp.so.1 must resolve to the runtime torch loaded.
        library = ctypes.CDLL(str(build_library(build_dir or cache_dir() / "kernels", cc)))
    except (KernelBuildError, OSError) as exc:
        log.warning("CPU kernels unavailable, running their PyTorch references: %s", exc)
        return None
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
        "textgate_int8_vnni": (ctypes.c_int, []),
        "textgate_int4_dequantize": (None, [pointer, pointer, *[int64] * 3, pointer]),
        "textgate_int8_linear": (
            ctypes.c_int,
            [pointer, int64, int64, flag, *[pointer] * 6, int64, flag],
        ),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library
