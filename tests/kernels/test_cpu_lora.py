"""cpu_lora.c through `LoraLayer.add`: a step's LoRA updates in one C call, against the
definition in float64 and against the batched matmuls it replaces."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels import cpu_build, cpu_isa
from textgate.kernels.cpu_lora import CpuLoraForm
from textgate.shard_server.layers.lora import LoraLayer, LoraRows, lora_rows

needs_the_kernel = pytest.mark.skipif(
    cpu_build.loaded_level() == "portable" and cpu_isa.is_x86(),
    reason="x86's portable build leaves LoRA updates to torch.bmm",
)

IN, PARTS = 40, ((0, 24), (24, 32), (32, 40))  # a fused q/k/v of 24 + 8 + 8 outputs


def layer(dtype: torch.dtype) -> LoraLayer:
    """Slots 1-3: slot 2 has no k part, slot 3 rank 4 where the others have 8; a `seed`ed
    random A and B each."""
    generator = torch.Generator().manual_seed(0)

    def random(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * 0.3).to(dtype)

    lora = LoraLayer(PARTS[-1][1])
    for slot in (1, 2, 3):
        rank = 4 if slot == 3 else 8
        lora.updates[slot] = [
            (start, end, random(rank, IN), random(end - start, rank), 0.5 * slot)
            for start, end in PARTS
            if not (slot == 2 and start == 24)
        ]
    return lora


def reference(lora: LoraLayer, x: torch.Tensor, out: torch.Tensor, slots: list[int]):
    """out + each row's update, in float64."""
    want = out.double().clone()
    for row, slot in enumerate(slots):
        for start, end, a, b, scale in lora.updates.get(slot, []):
            want[row, start:end] += (x[row].double() @ a.double().T) @ b.double().T * scale
    return want


def run(lora: LoraLayer, x: torch.Tensor, out: torch.Tensor, slots: list[int]) -> torch.Tensor:
    rows = LoraRows.from_slots(slots, x.device)
    with lora_rows(rows):
        return lora.add(x, out.clone())


@needs_the_kernel
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 0.02)])
# Decodes, a short chunk, and a prompt's: the same kernel at every size.
@pytest.mark.parametrize("num_rows", [1, 5, 32, 129, 1024])
def test_the_kernel_adds_each_rows_own_update(dtype, tolerance, num_rows) -> None:
    lora = layer(dtype)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, IN, generator=generator).to(dtype)
    out = torch.randn(num_rows, PARTS[-1][1], generator=generator).to(dtype)
    # Base rows (0), every slot, and slot 4, which this layer has no update for.
    slots = [(row * 3 + 1) % 5 for row in range(num_rows)]
    got = run(lora, x, out, slots)
    assert lora.cpu_form() is not None, "the kernel ran"
    want = reference(lora, x, out, slots)
    # bfloat16: the update is summed in float and the sum rounded once, to out's dtype.
    assert (got.double() - want).abs().max().item() <= tolerance * max(1.0, want.abs().max())
    untouched = [row for row, slot in enumerate(slots) if slot in (0, 4)]
    assert torch.equal(got[untouched], out[untouched])


@needs_the_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype) -> None:
    lora = layer(dtype)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(24, IN, generator=generator).to(dtype)
    out = torch.randn(24, PARTS[-1][1], generator=generator).to(dtype)
    slots = [1 + row % 3 for row in range(24)]
    together = run(lora, x, out, slots)
    for row in (0, 7, 23):
        alone = run(lora, x[row : row + 1], out[row : row + 1], slots[row : row + 1])
        assert torch.equal(alone[0], together[row])


@needs_the_kernel
def test_it_agrees_with_the_batched_matmuls_it_replaces(monkeypatch) -> None:
    lora = layer(torch.float32)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(16, IN, generator=generator)
    out = torch.randn(16, PARTS[-1][1], generator=generator)
    slots = [row % 4 for row in range(16)]
    kernel = run(lora, x, out, slots)
    monkeypatch.setattr(cpu_build, "load_library", lambda: None)
    lora.fuse()
    assert lora.cpu_form() is None
    batched = run(lora, x, out, slots)
    torch.testing.assert_close(kernel, batched, rtol=1e-5, atol=1e-5)


def test_x86s_portable_build_leaves_the_updates_to_torch(monkeypatch) -> None:
    lora = layer(torch.bfloat16)
    monkeypatch.setattr(cpu_build, "loaded_level", lambda: "portable")
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: True)
    assert CpuLoraForm.of(lora.updates) is None
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: False)  # an ARM's baseline has NEON
    assert CpuLoraForm.of(lora.updates) is not None


@needs_the_kernel
def test_it_declines_what_it_cannot_take() -> None:
    lora = layer(torch.float32)
    form = lora.cpu_form()
    assert form is not None
    x = torch.randn(IN, 4).T  # not contiguous
    out = torch.zeros(4, PARTS[-1][1])
    assert form.add(x, out, torch.zeros(4, dtype=torch.int64)) is None
    assert form.add(torch.randn(4, IN, dtype=torch.bfloat16), out, torch.zeros(4)) is None
    # float16 has no kernel: the layer's PyTorch path serves it.
    assert (
        CpuLoraForm.of({1: [(0, 4, torch.ones(2, 3).half(), torch.ones(4, 2).half(), 1.0)]}) is None
    )


@needs_the_kernel
@pytest.mark.skipif(
    "avx512_bf16" not in cpu_isa.cpu_features(), reason="the CPU has no vdpbf16ps to turn off"
)
def test_bfloat16_without_vdpbf16ps_widens_and_agrees_as_well() -> None:
    """The path a CPU without AVX512-BF16 takes (the choice is made once per process)."""
    import os
    import subprocess
    import sys

    env = os.environ | {"TEXTGATE_LORA_BF16_DOT": "0"}
    tests = [
        f"{__file__}::test_the_kernel_adds_each_rows_own_update",
        f"{__file__}::test_a_rows_result_does_not_depend_on_the_rows_beside_it",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:]
