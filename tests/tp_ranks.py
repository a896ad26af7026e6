"""Tensor parallel over gloo for tests: the same paged steps on two ranks and on one.

`spawn_ranks(run, paths, out_dir)` starts `WORLD_SIZE` processes that join one gloo
group and each save `run(path, group)` for every path as `out_dir/<name>-<rank>.pt`
(`rank_outputs` reads them back); the test compares those with `run(path, None)` in its
own process. `run` must be a module-level function: the spawned processes import its
module by the name it has inside the installed package (`textgate.tests....`), never by
the name pytest gave it (`tests....`, importable only with the checkout on `sys.path`,
which `make test` keeps off it).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from textgate.kernels import AttentionMetadata
from textgate.launcher import free_port

WORLD_SIZE = 2

#: (model folder, process group or None for one rank) -> one tensor per step.
RankRun = Callable[[Path, dist.ProcessGroup | None], list[torch.Tensor]]


def steps() -> list[AttentionMetadata]:
    """A prefill of two sequences, then a mixed step: one decodes, one prefills on a prefix."""
    first = AttentionMetadata.build(
        query_lens=[6, 9], context_lens=[0, 0], block_tables=[[3, 0], [5, 1, 7]], block_size=4
    )
    second = AttentionMetadata.build(
        query_lens=[1, 3], context_lens=[6, 9], block_tables=[[3, 0], [5, 1, 7]], block_size=4
    )
    return [first, second]


def step_logits(model: nn.Module) -> list[torch.Tensor]:
    """All-row logits of each of `steps()` for a paged model, on seeded prompt ids."""
    cache = model.allocate_kv_cache(num_blocks=8, block_size=4)
    ids = torch.randint(0, 100, (15 + 4,), generator=torch.Generator().manual_seed(0))
    outputs, offset = [], 0
    with torch.inference_mode():
        for metadata in steps():
            step_ids = ids[offset : offset + metadata.num_tokens]
            offset += metadata.num_tokens
            rows = torch.arange(metadata.num_tokens)
            outputs.append(model(step_ids, metadata.positions(), cache, metadata, rows))
    return outputs


def spawn_ranks(run: RankRun, paths: Sequence[Path], out_dir: Path) -> None:
    """Run `run` on every path in `WORLD_SIZE` gloo ranks; their outputs go to `out_dir`."""
    args = (free_port(), _package_name(run), list(paths), out_dir)
    mp.spawn(_worker, args=args, nprocs=WORLD_SIZE, join=True)


def _package_name(run: RankRun) -> tuple[str, str]:
    """`run`'s module as `textgate.<path inside the package>`, and its name in it."""
    import textgate

    module_file = Path(sys.modules[run.__module__].__file__ or "").resolve()
    inside = module_file.relative_to(Path(textgate.__file__).resolve().parent)
    return ".".join(("textgate", *inside.with_suffix("").parts)), run.__qualname__


def rank_outputs(out_dir: Path, path: Path, rank: int) -> list[torch.Tensor]:
    """What `rank` saved for `path` in `spawn_ranks`."""
    return torch.load(out_dir / f"{path.name}-{rank}.pt")


def _worker(
    rank: int, port: int, run_name: tuple[str, str], paths: list[Path], out_dir: Path
) -> None:
    module, qualname = run_name
    run: RankRun = getattr(importlib.import_module(module), qualname)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        for path in paths:
            torch.save(run(path, dist.group.WORLD), out_dir / f"{path.name}-{rank}.pt")
    finally:
        dist.destroy_process_group()
