"""Multi-node tensor parallel, the launcher's side: where each node's shards listen, how the
nodes find each other, and the heartbeat that stops every node when one goes.

`--num-shard N --nnodes K`: one launcher per node, each starting N / K shards, ranks
`node_rank * N / K` onwards, that meet over torch.distributed at `--master-addr`:
`--master-port` (gloo on CPU, NCCL on GPU). Node 0 also runs the router; the others are
headless. Rank r listens on its unix socket, as on one node, and with more than one node on
TCP port `--shard-port` + r too, plaintext (docs/scaling.md: no TLS):

- a headless node's ranks advertise `--shard-host` (or this host's address on its route to
  `--master-addr`) and that port; after loading, the ranks all-gather their addresses over
  the process group, so rank 0's ServiceDiscovery lists them and the router dials the
  other nodes' ranks over TCP, its own node's over their sockets;
- node 0's launcher reads that list from rank 0 and watches every other node's rank with
  gRPC Health (`PeerWatch`); each headless launcher watches rank 0 at `--master-addr`:
  `--shard-port`. Health is answered by a shard's event loop while its model thread
  steps, and a call has a deadline, so a dead or unreachable peer is noticed without
  waiting on a collective that may never return.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from textgate.launcher_flags import LauncherConfig
from textgate.shard_server.flag_types import tcp_url

log = logging.getLogger("textgate.launcher")

HEARTBEAT_INTERVAL_S = 0.5
"""How often each peer's Health is called."""
HEARTBEAT_TIMEOUT_S = 1.0
"""The deadline of one Health call."""
PEER_SILENT_S = 3.0
"""A peer that answered no Health for this long (its host gone, its process hung) is lost."""
PEER_REFUSALS = 2
"""A peer refused (UNAVAILABLE: its process is gone, the connection reset) this many
calls in a row is lost."""
PEER_STARTUP_S = 120.0
"""How long a peer has to answer its first Health once this node's shards are ready (they
are ready only once every rank joined the group, so the peer is up or about to be)."""


def shard_network_argv(config: LauncherConfig, rank: int) -> list[str]:
    """Shard `rank`'s listening flags: none on one node; with several, its TCP port, and
    on a headless node the address the router dials it at."""
    if config.nnodes == 1:
        return []
    argv = ["--tcp-port", str(config.shard_port + rank)]
    if config.headless:
        argv += ["--advertise-host", config.shard_host or "auto"]
    return argv


def shard_env(config: LauncherConfig, rank: int) -> dict[str, str]:
    """torch.distributed's variables for shard `rank` (LOCAL_RANK picks its GPU)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(config.num_shard),
        "LOCAL_RANK": str(rank - config.node_ranks.start),
        "LOCAL_WORLD_SIZE": str(config.shards_per_node),
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(config.master_port),
    }


def master_url(config: LauncherConfig) -> str:
    """Where a headless node reaches rank 0: `--master-addr`:`--shard-port`."""
    return tcp_url(config.master_addr, config.shard_port)


def discover_remote_ranks(uds_path: str, timeout_s: float = 10.0) -> dict[int, str]:
    """Rank 0's ServiceDiscovery (at unix://{uds_path}-0): the ranks it lists over TCP,
    those of the other nodes, by rank."""
    from textgate.proto import generate_pb2 as pb
    from textgate.proto import generate_pb2_grpc as pb_grpc

    url = f"unix://{uds_path}-0"
    with grpc.insecure_channel(url) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        try:
            urls = stub.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=timeout_s).urls
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else type(exc).__name__
            raise PeerLost(f"rank 0 at {url} did not list the group's ranks ({code})") from exc
    return {rank: url for rank, url in enumerate(urls) if not url.startswith("unix:")}


class PeerLost(RuntimeError):
    """A shard on another node stopped answering: the group cannot step any more."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}: the group cannot step without it, stopping this node")


@dataclass
class _Peer:
    name: str
    url: str
    last_answer: float | None = None
    refusals: int = 0


class PeerWatch:
    """Calls every peer's Health each HEARTBEAT_INTERVAL_S from one thread (the calls in
    parallel, each within HEARTBEAT_TIMEOUT_S); `lost` says which one stopped answering.

    A peer is lost when it refused PEER_REFUSALS calls in a row or answered none for
    PEER_SILENT_S; before its first answer it has PEER_STARTUP_S.
    """

    def __init__(
        self,
        peers: dict[str, str],
        *,
        interval_s: float = HEARTBEAT_INTERVAL_S,
        timeout_s: float = HEARTBEAT_TIMEOUT_S,
        silent_s: float = PEER_SILENT_S,
        refusals: int = PEER_REFUSALS,
        startup_s: float = PEER_STARTUP_S,
    ) -> None:
        """`peers`: name (as the log says it) -> gRPC address."""
        self._peers = [_Peer(name, url) for name, url in peers.items()]
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._silent_s = silent_s
        self._refusals = refusals
        self._startup_s = startup_s
        self._closed = threading.Event()
        self._lost: str | None = None
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        if self._peers:
            self._thread.start()
        return self

    def lost(self) -> str | None:
        """Why a peer counts as lost (None while all answer)."""
        return self._lost

    def wait_lost(self, timeout_s: float) -> str | None:
        """Block until a peer is lost (its reason) or `timeout_s` passed (None)."""
        self._changed.wait(timeout_s)
        return self._lost

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._timeout_s + 1)

    def _run(self) -> None:
        from textgate.proto import generate_pb2 as pb
        from textgate.proto import generate_pb2_grpc as pb_grpc

        channels = [grpc.insecure_channel(peer.url) for peer in self._peers]
        stubs = [pb_grpc.TextGenerationServiceStub(channel) for channel in channels]
        started = time.monotonic()
        try:
            while not self._closed.is_set():
                tick = time.monotonic()
                calls = [
                    s.Health.future(pb.HealthRequest(), timeout=self._timeout_s) for s in stubs
                ]
                for peer, call in zip(self._peers, calls, strict=True):
                    reason = self._check(peer, call, started)
                    if reason is not None and self._lost is None:
                        self._lost = reason
                        self._changed.set()
                if self._lost is not None:
                    return
                self._closed.wait(max(0.0, self._interval_s - (time.monotonic() - tick)))
        finally:
            for channel in channels:
                channel.close()

    def _check(self, peer: _Peer, call: grpc.Future, started: float) -> str | None:
        """Record one Health call's outcome; the reason `peer` is lost, if it now is."""
        try:
            call.result()
        except grpc.RpcError as exc:
            now = time.monotonic()
            code = exc.code() if isinstance(exc, grpc.Call) else None
            detail = code.name if code is not None else type(exc).__name__
            if peer.last_answer is None:
                if now - started > self._startup_s:
                    return (
                        f"{peer.name} at {peer.url} never answered in {self._startup_s:g} s "
                        f"({detail})"
                    )
                return None
            peer.refusals = peer.refusals + 1 if code == grpc.StatusCode.UNAVAILABLE else 0
            silent = now - peer.last_answer
            if peer.refusals >= self._refusals or silent > self._silent_s:
                return f"{peer.name} at {peer.url} stopped answering ({detail}, {silent:.1f} s)"
            return None
        peer.last_answer = time.monotonic()
        peer.refusals = 0
        return None


def peers_of(config: LauncherConfig, remote_ranks: dict[int, str]) -> dict[str, str]:
    """What this node watches: node 0 the other nodes' ranks, a headless node rank 0."""
    if config.nnodes == 1:
        return {}
    if config.headless:
        return {"rank 0 (node 0)": master_url(config)}
    per_node = config.shards_per_node
    return {f"rank {r} (node {r // per_node})": url for r, url in sorted(remote_ranks.items())}


def describe(config: LauncherConfig) -> str:
    """One line: this node's place in the group."""
    ranks: Sequence[int] = config.node_ranks
    role = "headless: shards only" if config.headless else "the router and its shards"
    return (
        f"Node {config.node_rank} of {config.nnodes}: ranks {ranks[0]}..{ranks[-1]} of "
        f"{config.num_shard} ({role}); rendezvous at {config.master_addr}:{config.master_port}"
    )
