"""The Triton programs compile for NVIDIA GPUs, on a machine without one.

The interpreter (which the other Triton tests use without a GPU) runs programs as Python
and accepts constructs the compiler rejects. Here a subprocess without TRITON_INTERPRET
compiles each program through triton's whole pipeline (TTIR, TTGIR, LLVM, PTX, ptxas) to
a cubin for sm_90 (H100/H200), in the configurations the backends launch on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from textgate.kernels.triton import attention_kernels as ak, layer_kernels as lk

def compile_(fn, types, constexprs):
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in fn.arg_names
    }
    source = ASTSource(fn, signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print("compiled", fn.__name__, flush=True)

def attention_types(query, cache, quantized):
    scales = "*fp32" if quantized else f"*{cache}"
    types = {name: "*i64" for name in ak.paged_prefill_kernel.arg_names if name.endswith("_ptr")}
    types.update({
        "query_ptr": f"*{query}", "out_ptr": f"*{query}", "key_cache_ptr": f"*{cache}",
        "value_cache_ptr": f"*{cache}", "key_scales_ptr": scales, "value_scales_ptr": scales,
        "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
        "qk_scale": "fp32",
    })
    return types

common = dict(HEAD_DIM=128, BLOCK_D=128, UPCAST=False)
for query, cache, quantized, splits, window in [
    ("bf16", "bf16", False, 1, False),
    ("fp16", "fp8e4nv", True, 8, True),
]:
    compile_(ak.paged_decode_kernel, attention_types(query, cache, quantized), dict(
        GROUP=4, BLOCK_G=16, BLOCK_SIZE=16, BLOCK_N=64, SPLIT=splits > 1, QUANTIZED=quantized,
        USE_WINDOW=window, **common))
for query, cache, quantized, block_size, window in [
    ("bf16", "bf16", False, 16, False),
    ("bf16", "i8", True, 64, True),
]:
    compile_(ak.paged_prefill_kernel, attention_types(query, cache, quantized), dict(
        GROUP=4, BLOCK_G=4, BLOCK_Q=16, BLOCK_SIZE=block_size, BLOCK_N=64, QUANTIZED=quantized,
        USE_WINDOW=window, **common))
compile_(ak.paged_decode_reduce_kernel,
         {"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
          "out_ptr": "*bf16"},
         dict(BLOCK_S=8, HEAD_DIM=128, BLOCK_D=128))
bf16 = lambda *names: {name: "*bf16" for name in names}
compile_(lk.add_rms_norm_kernel,
         {**bf16("x_ptr", "residual_ptr", "weight_ptr", "normed_ptr", "total_ptr"), "eps": "fp32"},
         dict(HAS_RESIDUAL=True, BLOCK=4096))
compile_(lk.rotary_kernel, bf16("qk_ptr", "cos_ptr", "sin_ptr"),
         dict(HALF=64, BLOCK_H=16, BLOCK_HALF=64))
compile_(lk.silu_and_mul_kernel, bf16("gate_up_ptr", "out_ptr"), dict(BLOCK=1024))
compile_(lk.store_kv_kernel,
         {**bf16("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"),
          "slot_mapping_ptr": "*i64"},
         dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="triton ships Linux wheels only")
def test_programs_compile_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile anew, whatever ran before
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("compiled") == 9
