"""`textgate-launcher`: parse TGI's flags, start the shards and the router, supervise them.

Every flag can also come from the environment variable of the same name in upper case
(`--max-total-tokens` <- `MAX_TOTAL_TOKENS`), as with TGI's launcher. A child that dies
stops the others; the launcher then exits non-zero and shows the child's last stderr lines.
With `--nnodes` > 1 there is one launcher per node (launcher_nodes.py): node 0's runs the
router, each watches the other nodes' shards, and one node lost stops them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

# launcher_flags holds the flag table; its names (and the flag parsers) stay importable here.
from textgate.launcher_flags import FLAGS, LauncherConfig, parse_bool
from textgate.launcher_flags import QUANTIZE_METHODS as QUANTIZE_METHODS
from textgate.launcher_nodes import (
    PeerLost,
    PeerWatch,
    describe,
    discover_remote_ranks,
    peers_of,
    shard_env,
    shard_network_argv,
)
from textgate.logs import level_from_env, setup_logging
from textgate.shard_server.flag_types import cuda_graph_sizes as cuda_graph_sizes

log = logging.getLogger("textgate.launcher")

_STDERR_TAIL = 40
# After its drain, the router still closes connections (router.server.DRAIN_EXIT_TIMEOUT_S)
# and flushes its last spans (telemetry.SHUTDOWN_TIMEOUT_S).
ROUTER_EXIT_MARGIN_S = 10.0
SHARD_EXIT_TIMEOUT_S = 10.0
# After a failure every child is stopped at once, the shards within this (the router's
# calls to them then fail at once, ending its streams with error events): a rank blocked
# in a collective with a dead peer does not exit on SIGTERM, and is killed.
FAILED_SHARDS_EXIT_TIMEOUT_S = 1.0


def _graph_sizes_text(sizes: Sequence[int]) -> str:
    return ",".join(map(str, sizes)) or "0"


def parse_args(
    argv: Sequence[str] | None = None, env: dict[str, str] | None = None
) -> LauncherConfig:
    """Flags first, then the upper-case env var of each flag (then the other env vars
    it names, LeaderWorkerSet's for the multi-node flags), then its default."""
    env = dict(os.environ) if env is None else env
    parser = argparse.ArgumentParser(prog="textgate-launcher", description=__doc__)
    for flag in FLAGS:
        env_name = next((name for name in flag.env_names if name in env), None)
        default = flag.default
        if env_name is not None:
            try:
                default = flag.type(env[env_name])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                # An error only if no flag overrides it (checked once argv is parsed).
                default = _BadEnv(f"--{flag.name} from env {env_name}={env[env_name]!r}: {exc}")
        where = ", ".join(flag.env_names)
        kwargs: dict[str, Any] = {"default": default, "help": f"{flag.help} [env: {where}]"}
        if flag.type is parse_bool:
            kwargs.update(nargs="?", const=True, type=parse_bool)
        else:
            kwargs.update(type=flag.type, choices=flag.choices)
        names = [f"--{flag.name}"]
        if flag.name == "max-input-tokens":
            names.append("--max-input-length")  # TGI's older name
        parser.add_argument(*names, **kwargs)
    namespace = parser.parse_args(argv)
    bad_env = [v.message for v in vars(namespace).values() if isinstance(v, _BadEnv)]
    if bad_env:
        parser.error("; ".join(bad_env))
    try:
        return LauncherConfig(**vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))
        raise


class _BadEnv:
    """An env var's value its flag's parser refused, kept as the flag's default (not a str:
    argparse would parse it)."""

    def __init__(self, message: str) -> None:
        self.message = message


class Child:
    """A supervised process whose stderr is echoed and whose last lines are kept."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.tail: deque[str] = deque(maxlen=_STDERR_TAIL)
        self.process = subprocess.Popen(
            argv, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout: float = 10.0) -> None:
        self.terminate()
        self.wait_or_kill(timeout)

    def terminate(self) -> None:
        """SIGTERM, if it still runs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_or_kill(self, timeout: float) -> None:
        """Wait up to `timeout` s for it to exit, then SIGKILL it."""
        try:
            self.process.wait(max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=2)


class ChildFailed(RuntimeError):
    def __init__(self, child: Child) -> None:
        self.child = child
        code = child.poll()
        lines = "\n".join(f"    {line}" for line in child.tail) or "    (no stderr)"
        super().__init__(f"{child.name} exited with code {code}. Its last stderr lines:\n{lines}")


def model_limits(model_path: Path, config: LauncherConfig) -> dict[str, int]:
    """TGI's defaults: total = min(model, 4096), input = total - 1."""
    model_config = json.loads((model_path / "config.json").read_text())
    model_max = int(model_config.get("max_position_embeddings") or 4096)
    total = config.max_total_tokens or min(model_max, 4096)
    max_input = config.max_input_tokens or total - 1
    if max_input >= total:
        raise ValueError(f"max input tokens {max_input} must be below max total tokens {total}")
    return {
        "max_total_tokens": total,
        "max_input_tokens": max_input,
        # Unset: the router picks it once it knows the shards (router/config.py).
        "max_batch_prefill_tokens": config.max_batch_prefill_tokens,
    }


PYTHON_MODULE = (sys.executable, "-P", "-m")
"""How the children start: `-P` keeps the working directory off their `sys.path`. Run from
a checkout, its top-level folders (`kernels`, `router`, `proto`...) would otherwise shadow
PyPI packages of those names (transformers >= 5.25 imports the `kernels` distribution)."""


def shard_argv(
    model_path: Path, config: LauncherConfig, draft_path: Path | None = None
) -> list[str]:
    """A shard's command line (`draft_path`: the resolved --speculative-model)."""
    argv = [*PYTHON_MODULE, "textgate.shard_server", "--model-path", str(model_path)]
    argv += ["--model-id", served_model_id(config)]
    argv += ["--uds-path", config.shard_uds_path, "--dtype", config.dtype]
    argv += [
        "--block-size",
        str(config.block_size),
        "--kv-cache-memory",
        str(config.kv_cache_memory),
    ]
    argv += ["--cuda-memory-fraction", str(config.cuda_memory_fraction)]
    argv += ["--kv-cache-dtype", config.kv_cache_dtype]
    argv += ["--attention", config.attention]
    argv += ["--cuda-graphs", _graph_sizes_text(config.cuda_graphs)]
    if config.kv_offload_dir is not None:
        argv += ["--kv-offload-dir", config.kv_offload_dir]
    if config.quantize is not None:
        argv += ["--quantize", config.quantize]
    if draft_path is not None:
        argv += ["--speculative-model-path", str(draft_path)]
        if config.speculative_quantize is not None:
            argv += ["--speculative-quantize", config.speculative_quantize]
    if config.lora_adapters:
        argv += ["--lora-adapters", ",".join(f"{n}={p}" for n, p in config.lora_adapters)]
    argv += ["--max-loras", str(config.max_loras), "--max-lora-rank", str(config.max_lora_rank)]
    if config.max_cpu_loras is not None:
        argv += ["--max-cpu-loras", str(config.max_cpu_loras)]
    if config.trust_remote_code:
        argv.append("--trust-remote-code")
    if config.json_output:
        argv.append("--json-output")
    if config.otlp_endpoint is not None:
        argv += ["--otlp-endpoint", config.otlp_endpoint]
        argv += ["--otlp-service-name", config.otlp_service_name]
    return argv


def served_model_id(config: LauncherConfig) -> str:
    """The name /info and /v1/models show: --model-id, or the embedded model's hub name."""
    from textgate.shard_server.loading.model_source import DEFAULT_MODEL_ID

    return config.model_id or DEFAULT_MODEL_ID


def router_config(model_path: Path, config: LauncherConfig) -> dict[str, Any]:
    """The router's settings: every `RouterConfig` field the launcher has a flag for, by
    name, plus the model's limits and where its tokenizer is."""
    from textgate.router.config import RouterConfig  # no torch: a plain dataclass

    launcher_fields = {f.name for f in fields(LauncherConfig)}
    settings: dict[str, Any] = {
        f.name: getattr(config, f.name) for f in fields(RouterConfig) if f.name in launcher_fields
    }
    settings.update(model_limits(model_path, config))
    if config.no_adaptive:
        settings["target_itl_ms"] = 0.0
    settings["model_id"] = served_model_id(config)
    settings["tokenizer_path"] = str(model_path)
    return settings


class StopRequested(Exception):
    """A stop signal arrived while the model was loading."""


def wait_for_shards(
    children: list[Child],
    uds_path: str,
    timeout: float = 600.0,
    stop: threading.Event | None = None,
    ranks: Sequence[int] | None = None,
) -> None:
    """Poll every shard's Health until all answer; fail fast if one dies, and raise
    StopRequested as soon as `stop` is set. `ranks`: the children's (default 0, 1, ...)."""
    import grpc

    from textgate.proto import generate_pb2 as pb
    from textgate.proto import generate_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout
    for rank, child in zip(ranks or range(len(children)), children, strict=True):
        with grpc.insecure_channel(f"unix://{uds_path}-{rank}") as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            while True:
                if stop is not None and stop.is_set():
                    raise StopRequested()
                if child.poll() is not None:
                    raise ChildFailed(child)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shard {rank} not ready after {timeout:.0f}s")
                try:
                    stub.Health(pb.HealthRequest(), timeout=1.0)
                    break
                except grpc.RpcError:
                    time.sleep(0.2)
        log.info("Shard %d ready", rank)


def start_shards(
    model_path: Path, config: LauncherConfig, draft_path: Path | None = None
) -> list[Child]:
    """This node's shards: ranks `config.node_ranks` of `config.num_shard`."""
    children = []
    for rank in config.node_ranks:
        Path(f"{config.shard_uds_path}-{rank}").unlink(missing_ok=True)
        env = dict(os.environ)
        env.update(shard_env(config, rank))
        argv = shard_argv(model_path, config, draft_path) + shard_network_argv(config, rank)
        children.append(Child(f"shard {rank}", argv, env))
    return children


def start_router(model_path: Path, config: LauncherConfig) -> Child:
    settings = json.dumps(router_config(model_path, config))
    argv = [*PYTHON_MODULE, "textgate.router", "--config-json", settings]
    return Child("router", argv, dict(os.environ))


def supervise(children: list[Child], stop: threading.Event, peers: PeerWatch | None = None) -> None:
    """Block until a stop signal (return), a child's exit (raise ChildFailed) or another
    node's shard lost (raise PeerLost)."""
    while not stop.wait(0.2):
        for child in children:
            if child.poll() is not None:
                raise ChildFailed(child)
        lost = peers.lost() if peers is not None else None
        if lost is not None:
            raise PeerLost(lost)


def wait_for_master(
    children: list[Child], peers: PeerWatch, stop_now: threading.Event, timeout: float
) -> None:
    """A headless node asked to stop serves on until rank 0 is gone (the router drains
    first: a group deleted at once gets SIGTERM everywhere), `timeout` passes, one of its
    shards exits or a second signal comes."""
    log.info(
        "Stopping once rank 0 has stopped (the router drains first), within %.0f s; "
        "a second signal stops now",
        timeout,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop_now.is_set():
        if peers.wait_lost(0.2) is not None or any(c.poll() is not None for c in children):
            return


def run(config: LauncherConfig) -> int:
    from textgate.shard_server.loading.model_source import resolve_model

    stop, stop_now = threading.Event(), threading.Event()
    # Resolving (downloading, converting) runs in this thread: a signal interrupts it.
    # Once children exist, a signal only sets `stop`, which every wait polls.
    interrupt = True

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            stop_now.set()
        stop.set()
        if interrupt:
            raise StopRequested()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    children: list[Child] = []
    peers: PeerWatch | None = None
    failed = False
    try:
        model_path = resolve_model(config.model_id, config.revision)
        draft_path = draft_model_path(config)
        interrupt = False
        log.info("Serving %s from %s", config.model_id or "the embedded default model", model_path)
        if config.nnodes > 1:
            log.info("%s", describe(config))
        children = start_shards(model_path, config, draft_path)
        wait_for_shards(children, config.shard_uds_path, stop=stop, ranks=config.node_ranks)
        if stop.is_set():
            raise StopRequested()
        if config.nnodes > 1:
            remote = {} if config.headless else discover_remote_ranks(config.shard_uds_path)
            watched = peers_of(config, remote)
            peers = PeerWatch(watched).start()
            log.info("Watching %s", ", ".join(f"{n} at {u}" for n, u in watched.items()))
        if not config.headless:
            children.append(start_router(model_path, config))
        supervise(children, stop, peers)
        if config.headless and peers is not None and peers.lost() is None:
            wait_for_master(children, peers, stop_now, _master_stop_timeout(config))
        log.info("Stopping")
        return 0
    except StopRequested:
        log.info("Stopping while the model loads")
        return 0
    except (ChildFailed, PeerLost) as exc:
        failed = True
        log.error("%s", exc)
        return 1
    finally:
        interrupt = False
        if peers is not None:
            peers.close()
        stop_children(children, config, failed)


def draft_model_path(config: LauncherConfig) -> Path | None:
    """--speculative-model as a local folder ('embedded': the embedded default model's)."""
    from textgate.shard_server.loading.model_source import resolve_model

    if config.speculative_model is None:
        return None
    name = config.speculative_model
    return resolve_model(None if name == "embedded" else name)


def stop_children(children: list[Child], config: LauncherConfig, failed: bool) -> None:
    """Stop every child: the router first, draining (in-flight requests finish, within
    --graceful-termination-timeout) while the shards still serve it; after a failure all
    at once, the shards killed past FAILED_SHARDS_EXIT_TIMEOUT_S, so that the router's
    requests end in errors at once and its drain has nothing to wait for."""
    shards = [child for child in children if child.name != "router"]
    routers = [child for child in children if child.name == "router"]
    if not failed:
        for child in routers + shards[::-1]:
            child.stop(_stop_timeout(child, config))
        return
    for child in shards + routers:
        child.terminate()
    deadline = time.monotonic() + FAILED_SHARDS_EXIT_TIMEOUT_S
    for shard in shards:
        shard.wait_or_kill(deadline - time.monotonic())
    for router in routers:
        router.wait_or_kill(_stop_timeout(router, config))


def _master_stop_timeout(config: LauncherConfig) -> float:
    """How long a headless node asked to stop waits for rank 0 to go: the router's drain
    and exit."""
    return config.graceful_termination_timeout + ROUTER_EXIT_MARGIN_S


def _stop_timeout(child: Child, config: LauncherConfig) -> float:
    """How long a child may take to exit after SIGTERM before it is killed."""
    if child.name == "router":
        return config.graceful_termination_timeout + ROUTER_EXIT_MARGIN_S
    return SHARD_EXIT_TIMEOUT_S


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    try:
        level = level_from_env()
    except ValueError as exc:
        raise SystemExit(f"textgate-launcher: error: {exc}") from None
    setup_logging(config.json_output, "launcher", level)
    log.info("Args %s", json.dumps(dataclasses.asdict(config)))
    sys.exit(run(config))


def free_port() -> int:
    """A TCP port that is free right now on the loopback interface (for tests and bench)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    main()
