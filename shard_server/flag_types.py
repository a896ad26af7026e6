"""Parsers for shard flags the launcher also takes, and the addresses made of them,
importable without torch.

The launcher validates these before it spawns a shard; the shard's own CLI parses the
same text again. Both import them from here (the shard must not import the launcher).
"""

from __future__ import annotations

import argparse
import socket


def cuda_graph_sizes(text: str) -> tuple[int, ...]:
    """`--cuda-graphs`: comma-separated decode batch sizes, ascending; "0" (or "") = none."""
    if text.strip() in ("", "0"):
        return ()
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated batch sizes like 1,2,4,8, or 0, got {text!r}"
        ) from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(
            f"batch sizes must be positive (0 alone disables): {text!r}"
        )
    return tuple(sorted(set(sizes)))


def lora_adapters(text: str) -> tuple[tuple[str, str], ...]:
    """`--lora-adapters`, TGI's syntax: comma-separated `id=path` or `path` (its id: the
    folder's name); ids unique."""
    adapters: list[tuple[str, str]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, path = part.partition("=")
        if not sep:
            name, path = part.rstrip("/").rsplit("/", 1)[-1], part
        if not name or not path:
            raise argparse.ArgumentTypeError(f"expected id=path or a path, got {part!r}")
        adapters.append((name.strip(), path.strip()))
    names = [name for name, _ in adapters]
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"LoRA adapter ids must be unique: {names}")
    return tuple(adapters)


def tcp_url(host: str, port: int) -> str:
    """gRPC's address of `host`:`port` (an IPv6 literal in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def route_address(host: str, port: int) -> str:
    """This host's address on its route to `host` (a UDP socket's connect picks the
    interface and sends nothing): where another node can dial this one."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.connect(address)
        return str(sock.getsockname()[0])
