"""Multi-node launcher: --nnodes / --node-rank / --master-addr from flags, their env vars
and LeaderWorkerSet's, the errors, each node's ranks and shard flags, and the heartbeat
(`launcher_nodes.PeerWatch`) against real gRPC servers that stop or hang.
(Two launchers on one machine: tests/e2e/test_multinode.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from textgate import launcher, launcher_nodes
from textgate.launcher_nodes import PeerWatch
from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc
from textgate.shard_server.flag_types import route_address, tcp_url

LWS = {"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2", "LWS_LEADER_ADDRESS": "lead.svc"}


def test_one_node_by_default() -> None:
    config = launcher.parse_args([], env={})
    assert (config.nnodes, config.node_rank, config.master_addr) == (1, 0, "127.0.0.1")
    assert list(config.node_ranks) == [0] and not config.headless
    assert launcher_nodes.shard_network_argv(config, 0) == []
    assert launcher_nodes.peers_of(config, {}) == {}


def test_lws_env_is_read_when_no_flag_or_own_env_var_is_set() -> None:
    config = launcher.parse_args(["--num-shard", "8"], env=LWS)
    assert (config.nnodes, config.node_rank, config.master_addr) == (4, 2, "lead.svc")
    assert list(config.node_ranks) == [4, 5] and config.headless
    # The flag's own variable beats LWS's, and a flag beats both.
    env = {**LWS, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    config = launcher.parse_args(["--num-shard", "8"], env=env)
    assert (config.nnodes, config.node_rank, config.master_addr) == (2, 1, "10.0.0.1")
    argv = ["--num-shard", "8", "--nnodes", "8", "--node-rank", "0", "--master-addr", "h"]
    config = launcher.parse_args(argv, env=env)
    assert (config.nnodes, config.node_rank, config.master_addr) == (8, 0, "h")
    assert list(config.node_ranks) == [0] and not config.headless


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--num-shard", "3", "--nnodes", "2"], {}, "--num-shard 3 does not split evenly"),
        (["--nnodes", "0"], {}, "--nnodes must be at least 1"),
        (["--num-shard", "2", "--nnodes", "2", "--node-rank", "2"], {}, "--node-rank 2 is not"),
        (["--node-rank", "-1"], {}, "--node-rank -1 is not a node of --nnodes 1"),
        (["--num-shard", "2"], {**LWS, "LWS_GROUP_SIZE": "$(LWS_GROUP_SIZE)"}, "from env"),
        (["--num-shard", "4", "--nnodes", "2", "--shard-port", "65534"], {}, "65534 .. 65537"),
        (
            ["--num-shard", "4", "--nnodes", "2", "--shard-port", "29498"],
            {},
            "--master-port 29500 is one of the shards' ports",
        ),
    ],
)
def test_bad_node_settings_exit_with_a_clear_error(
    argv: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(argv, env=env)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unparsable_env_var_is_no_error_when_a_flag_overrides_it() -> None:
    env = {"LWS_GROUP_SIZE": "$(LWS_GROUP_SIZE)", "PORT": "http"}
    config = launcher.parse_args(["--nnodes", "1", "--port", "80"], env=env)
    assert config.nnodes == 1 and config.port == 80


def test_each_node_runs_its_share_of_the_global_ranks() -> None:
    argv = ["--num-shard", "4", "--nnodes", "2", "--master-addr", "10.0.0.1"]
    leader = launcher.parse_args([*argv, "--node-rank", "0"], env={})
    worker = launcher.parse_args([*argv, "--node-rank", "1", "--shard-host", "10.0.0.2"], env={})
    assert list(leader.node_ranks) == [0, 1] and list(worker.node_ranks) == [2, 3]
    assert launcher_nodes.shard_env(worker, 3) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    # Node 0's ranks listen on TCP too (rank 0 for the heartbeat); the router dials them
    # at their sockets. A worker's ranks advertise its address and their ports.
    assert launcher_nodes.shard_network_argv(leader, 1) == ["--tcp-port", "29601"]
    assert launcher_nodes.shard_network_argv(worker, 3) == [
        "--tcp-port",
        "29603",
        "--advertise-host",
        "10.0.0.2",
    ]
    auto = launcher.parse_args([*argv, "--node-rank", "1"], env={})
    assert launcher_nodes.shard_network_argv(auto, 2)[-1] == "auto"
    # Node 0 watches the other nodes' ranks, a worker rank 0.
    remote = {2: "10.0.0.2:29602", 3: "10.0.0.2:29603"}
    assert launcher_nodes.peers_of(leader, remote) == {
        "rank 2 (node 1)": "10.0.0.2:29602",
        "rank 3 (node 1)": "10.0.0.2:29603",
    }
    assert launcher_nodes.peers_of(worker, {}) == {"rank 0 (node 0)": "10.0.0.1:29600"}
    assert "Node 1 of 2: ranks 2..3 of 4 (headless" in launcher_nodes.describe(worker)


def test_addresses() -> None:
    assert tcp_url("10.0.0.1", 1) == "10.0.0.1:1"
    assert tcp_url("fe80::1", 2) == "[fe80::1]:2" and tcp_url("[::1]", 3) == "[::1]:3"
    assert route_address("127.0.0.1", 29500) == "127.0.0.1"


def test_the_shard_advertises_its_socket_or_its_tcp_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from textgate.shard_server.__main__ import advertised_url, parse_args

    base = ["--model-path", "/m", "--uds-path", "/tmp/x"]
    assert advertised_url(parse_args(base), 3) == "unix:///tmp/x-3"
    argv = [*base, "--tcp-port", "29603", "--advertise-host", "10.1.2.3"]
    assert advertised_url(parse_args(argv), 3) == "10.1.2.3:29603"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    argv = [*base, "--tcp-port", "29603", "--advertise-host", "auto"]
    assert advertised_url(parse_args(argv), 3) == "127.0.0.1:29603"
    with pytest.raises(ValueError, match="--advertise-host needs --tcp-port"):
        advertised_url(parse_args([*base, "--advertise-host", "auto"]), 3)


class _Health(pb_grpc.TextGenerationServiceServicer):
    def __init__(self, urls: tuple[str, ...] = ()) -> None:
        self.hang = threading.Event()
        self.urls = urls

    def ServiceDiscovery(
        self, request: pb.ServiceDiscoveryRequest, context: Any
    ) -> pb.ServiceDiscoveryResponse:
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        if self.hang.is_set():
            time.sleep(5)
        return pb.HealthResponse()


@contextmanager
def _health_server(
    uds: str | None = None, urls: tuple[str, ...] = ()
) -> Iterator[tuple[grpc.Server, _Health, str]]:
    """A shard stand-in on 127.0.0.1 (or on unix://{uds}-0) answering Health and
    ServiceDiscovery (`urls`)."""
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    servicer = _Health(urls)
    pb_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    if uds is None:
        url = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    else:
        url = f"unix://{uds}-0"
        server.add_insecure_port(url)
    server.start()
    try:
        yield server, servicer, url
    finally:
        server.stop(grace=None)


def test_node_0_learns_the_other_nodes_ranks_from_rank_0(tmp_path: Path) -> None:
    uds = str(tmp_path / "s")
    urls = (f"unix://{uds}-0", f"unix://{uds}-1", "10.0.0.2:29602", "[fe80::2]:29603")
    with _health_server(uds, urls):
        remote = launcher_nodes.discover_remote_ranks(uds)
    assert remote == {2: "10.0.0.2:29602", 3: "[fe80::2]:29603"}
    with pytest.raises(launcher_nodes.PeerLost, match="did not list the group's ranks"):
        launcher_nodes.discover_remote_ranks(uds, timeout_s=0.5)


FAST = {"interval_s": 0.1, "timeout_s": 0.3, "silent_s": 1.0, "startup_s": 2.0}


def _lost_within(watch: PeerWatch, seconds: float) -> tuple[str | None, float]:
    started = time.monotonic()
    reason = watch.wait_lost(seconds)
    return reason, time.monotonic() - started


def test_a_peer_that_stops_is_lost_within_a_few_heartbeats() -> None:
    with _health_server() as (server, _, url):
        watch = PeerWatch({"rank 1 (node 1)": url}, **FAST).start()
        try:
            assert watch.wait_lost(0.5) is None, "an answering peer is not lost"
            server.stop(grace=None)
            reason, took = _lost_within(watch, 5)
        finally:
            watch.close()
    assert reason is not None and reason.startswith(f"rank 1 (node 1) at {url} stopped")
    assert "UNAVAILABLE" in reason
    assert took < 1.0, "two refusals in a row, a heartbeat apart"


def test_a_peer_that_hangs_is_lost_once_silent_past_the_limit() -> None:
    with _health_server() as (_, servicer, url):
        watch = PeerWatch({"rank 0 (node 0)": url}, **FAST).start()
        try:
            assert watch.wait_lost(0.5) is None
            servicer.hang.set()
            reason, took = _lost_within(watch, 5)
        finally:
            watch.close()
    assert reason is not None and "DEADLINE_EXCEEDED" in reason
    assert 0.9 < took < 2.0, "lost after silent_s without an answer, not at the first timeout"


def test_a_peer_gets_its_startup_time_before_its_first_answer() -> None:
    with _health_server() as (_, _, url):
        pass
    # Nothing listens there now: refused, but within the startup allowance.
    watch = PeerWatch({"rank 0 (node 0)": url}, **FAST).start()
    try:
        assert watch.wait_lost(1.0) is None
        reason, took = _lost_within(watch, 5)
    finally:
        watch.close()
    assert reason is not None and "never answered in 2 s" in reason and took < 2.0


def test_supervise_raises_peer_lost() -> None:
    with _health_server() as (server, _, url):
        watch = PeerWatch({"rank 1 (node 1)": url}, **FAST).start()
        server.stop(grace=None)
        try:
            with pytest.raises(launcher_nodes.PeerLost, match="cannot step without it"):
                launcher.supervise([], threading.Event(), watch)
        finally:
            watch.close()
