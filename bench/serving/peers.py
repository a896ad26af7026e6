"""`python -m textgate.bench.serving.peers`: textgate and a peer server side by side, one run.

Starts textgate (`textgate-launcher`, any flags after `--textgate-args`) and a peer on
free ports, waits until both are healthy, then runs `textgate-bench --url TEXTGATE
--compare PEER …` with the remaining arguments, so both see the same prompts in the same
session and the ratios are measured, not recalled. Both servers stay up for the whole run;
the idle one costs nothing measurable.

    python -m textgate.bench.serving.peers --peer transformers --peer-venv build/peers/transformers \\
        -- --backend openai-chat --dataset conversations --output-len 64 --concurrency 1,8,32 \\
           --no-ignore-eos
    python -m textgate.bench.serving.peers --peer llama-cpp --peer-venv build/peers/llama-cpp \\
        --textgate-args="--quantize int8" -- --backend openai-chat --concurrency 1,8
    python -m textgate.bench.serving.peers --peer vllm --peer-venv build/peers/vllm \\
        -- --backend openai-chat --dataset conversations --concurrency 1,8,32 --no-ignore-eos
    python -m textgate.bench.serving.peers --peer textgate --peer-args=--no-adaptive \\
        -- --backend tgi --concurrency 32

Peers (each in its own venv; `make bench-peers` creates them):
- `transformers`: `transformers serve MODEL_DIR --continuous-batching --cb-block-size 32
  --cb-num-blocks 192 --cb-max-batch-tokens 256 --device cpu` on the converted default model.
- `llama-cpp`: llama-cpp-python's server on the embedded GGUF, `--n_threads 2
  --interrupt_requests False` (it serializes requests; interrupting would cut them).
- `vllm`: vLLM's CPU build (`vllm-cpu`), `python -m vllm.entrypoints.openai.api_server
  --model MODEL_DIR --dtype float32` on the converted default model, with
  `VLLM_CPU_OMP_THREADS_BIND=0-{threads-1} VLLM_CPU_NUM_OF_RESERVED_CPU=0` (every core
  computes; its default keeps one for the API server) and 2 GiB of KV cache. Its first
  start compiles for minutes; the health wait allows `--startup-timeout` (15 min).
- `textgate`: textgate itself with other flags (`--peer-args`), for A/B runs of one flag.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from textgate.bench.serving import cli
from textgate.bench.serving.sweep import ServerCommand, launcher_command, running_server

PEERS = ("transformers", "llama-cpp", "vllm", "textgate")
# Where each peer answers 200 once it can serve (llama-cpp-python has no /health).
HEALTH_PATHS = {
    "transformers": "/health",
    "llama-cpp": "/v1/models",
    "vllm": "/health",
    "textgate": "/health",
}


def _transformers(venv: Path, threads: int, where: list[str]) -> list[str]:
    from textgate.shard_server.loading.model_source import embedded_model_dir

    return [
        str(venv / "bin" / "transformers"),
        "serve",
        str(embedded_model_dir()),
        "--continuous-batching",
        "--cb-block-size",
        "32",
        "--cb-num-blocks",
        "192",
        "--cb-max-batch-tokens",
        "256",
        "--device",
        "cpu",
        *where,
    ]


def _llama_cpp(venv: Path, threads: int, where: list[str]) -> list[str]:
    from textgate.shard_server.loading.model_source import embedded_gguf_path

    return [
        str(venv / "bin" / "python"),
        "-m",
        "llama_cpp.server",
        "--model",
        str(embedded_gguf_path()),
        "--n_threads",
        str(threads),
        "--interrupt_requests",
        "False",
        "--n_ctx",
        "4096",
        *where,
    ]


def _vllm(venv: Path, threads: int, where: list[str]) -> list[str]:
    from textgate.shard_server.loading.model_source import embedded_model_dir

    # The `vllm` console script looks up the distribution `vllm`, which vllm-cpu is not.
    return [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(embedded_model_dir()),
        "--dtype",
        "float32",
        *where,
    ]


_COMMANDS = {"transformers": _transformers, "llama-cpp": _llama_cpp, "vllm": _vllm}


def peer_command(peer: str, venv: Path, threads: int) -> ServerCommand:
    """The peer's server command line on a given port, serving the embedded default model."""
    build = _COMMANDS[peer]

    def command(port: int) -> list[str]:
        return build(venv, threads, ["--host", "127.0.0.1", "--port", str(port)])

    return command


def peer_env(peer: str, threads: int) -> dict[str, str]:
    """Environment variables the peer's server needs on top of this process's."""
    if peer != "vllm":
        return {}
    # vLLM's CPU build computes on cores 0..threads-1 only when told; by default it keeps
    # one core for its API server, which on a 2-core machine halves its compute.
    return {
        # `python -m` (vLLM's and its subprocesses') puts the working directory first on
        # sys.path; in a textgate checkout its `kernels/` shadows the PyPI package
        # transformers probes for.
        "PYTHONSAFEPATH": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.serving.peers",
        description="textgate and a peer server side by side; arguments after `--` go to "
        "textgate-bench (its --url and --compare are set here).",
    )
    parser.add_argument("--peer", choices=PEERS, required=True)
    parser.add_argument(
        "--peer-venv", type=Path, default=None, help="the peer's virtualenv (not for textgate)"
    )
    parser.add_argument("--peer-args", default="", help="textgate peer: its launcher flags")
    parser.add_argument(
        "--threads", type=int, default=2, help="llama-cpp: --n_threads; vllm: cores 0..N-1"
    )
    parser.add_argument(
        "--textgate-args", default="", help="extra textgate-launcher flags, one string"
    )
    parser.add_argument(
        "--peer-label", default=None, help="label of the peer in the report (default: --peer)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds each server may take to get healthy (vLLM's first start compiles: "
        "~3 min on an idle 2-core machine, ~10 under load)",
    )
    args, rest = parser.parse_known_args(argv)
    return args, [a for a in rest if a != "--"]


def main(argv: Sequence[str] | None = None) -> int:
    args, bench_args = parse_args(argv)
    if any(a in ("--url", "--compare") for a in bench_args):
        raise SystemExit("--url and --compare are set by this command")
    textgate = launcher_command(shlex.split(args.textgate_args))
    if args.peer == "textgate":
        peer = launcher_command(shlex.split(args.peer_args))
    elif args.peer_venv is None:
        raise SystemExit(f"--peer {args.peer} needs --peer-venv")
    else:
        peer = peer_command(args.peer, args.peer_venv, args.threads)
    with ExitStack() as stack:
        url = stack.enter_context(running_server(textgate, args.startup_timeout))
        health, env = HEALTH_PATHS[args.peer], peer_env(args.peer, args.threads)
        peer_url = stack.enter_context(
            running_server(peer, args.startup_timeout, health_path=health, env=env)
        )
        return cli.main(["--url", url, "--compare", peer_url, *bench_args])


if __name__ == "__main__":
    sys.exit(main())
