"""`python -m textgate.bench.serving.sweep` (`make bench`): textgate against the naive baseline.

1. Start a local textgate (`textgate-launcher --hostname 127.0.0.1 --port <free>`) and
   wait for `GET /health` to answer 200 (or use `--url` for a server already running).
2. Sweep closed-loop concurrency (default 1, 8, 32) with ~40-token prompts and exactly
   64 output tokens, then stop the server.
3. Run the naive transformers baseline on the same prompts (fewer of them: it is slow),
   and time the matmul-only roofline at the sweep's batch sizes, in the dtype the server
   reports in /info (bf16 for textgate on a CPU with AVX512-BF16).
4. Print all three and textgate's speedup over naive and its fraction of the roofline.

The defaults finish in well under ten minutes on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from textgate.bench.serving.cli import parse_list
from textgate.bench.serving.load import LoadLevel
from textgate.bench.serving.metrics import BenchmarkMetrics, compute_metrics
from textgate.bench.serving.report import (
    append_json_lines,
    format_metrics,
    format_results,
    format_table,
    metrics_record,
    ratio,
    result_record,
)
from textgate.bench.serving.runner import BenchConfig, RunResult, Target, log_stderr, run_benchmark
from textgate.bench.serving.tokenizer import BenchTokenizer, load_tokenizer
from textgate.bench.serving.workload import (
    BenchRequest,
    add_workload_args,
    build_requests,
    spec_from_args,
)

ServerCommand = Callable[[int], list[str]]
_LOG_TAIL_CHARS = 4000


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launcher_command(extra_args: Sequence[str] = ()) -> ServerCommand:
    """`textgate-launcher --hostname 127.0.0.1 --port P …` from this Python environment."""
    script = Path(sys.executable).with_name("textgate-launcher")
    if script.exists():
        base = [str(script)]
    else:
        base = [
            sys.executable,
            "-c",
            "import sys; from textgate.launcher import main; sys.exit(main())",
        ]

    def command(port: int) -> list[str]:
        return [*base, "--hostname", "127.0.0.1", "--port", str(port), *extra_args]

    return command


def _log_tail(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    return text[-_LOG_TAIL_CHARS:]


def wait_healthy(
    url: str,
    process: subprocess.Popen[bytes],
    log: Path,
    timeout_s: float,
    health_path: str = "/health",
) -> None:
    """Poll `GET {url}{health_path}` until 200; ServerStartError if the process dies or time
    runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"server exited with code {process.returncode}; its output:\n{_log_tail(log)}"
            )
        try:
            if httpx.get(url + health_path, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.5)
    raise ServerStartError(f"server not healthy after {timeout_s:.0f}s; output:\n{_log_tail(log)}")


def stop_process(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the server (it stops its shards), then SIGKILL its process group if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
    # The server was started in its own session: this group is it and the children it spawned.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    process.wait(timeout=grace_s)


@contextmanager
def running_server(
    command: ServerCommand,
    startup_timeout_s: float = 900.0,
    log: Callable[[str], None] = log_stderr,
    health_path: str = "/health",
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Start the server on a free port, yield its base URL once `health_path` answers 200,
    stop it afterwards. `env`: variables set for the server on top of this process's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(
        prefix="textgate-bench-server-", suffix=".log", delete=False
    ) as f:
        log_path = Path(f.name)
    argv = command(port)
    shown_env = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    log(f"starting: {shown_env + ' ' if env else ''}{' '.join(argv)} (output in {log_path})")
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
    succeeded = False
    try:
        wait_healthy(url, process, log_path, startup_timeout_s, health_path)
        log(f"server healthy at {url}")
        yield url
        succeeded = True
    finally:
        stop_process(process)
        if succeeded:
            log_path.unlink(missing_ok=True)
        else:
            log(f"server output kept in {log_path}")


@dataclass(frozen=True)
class Baselines:
    """What the server is compared with: the naive run and the roofline (tok/s per batch)."""

    naive: BenchmarkMetrics | None
    roofline_tok_s: dict[int, float]
    threads: int = 0  # torch intra-op threads both ran with
    roofline_dtype: str = ""


def run_naive_baseline(
    model_dir: Path, tokenizer: BenchTokenizer, requests: Sequence[BenchRequest], args: Any
) -> BenchmarkMetrics:
    """The naive transformers baseline on `requests` (the first one doubles as warmup)."""
    from textgate.bench.serving.naive import load_model, run_naive

    model = load_model(model_dir, args.dtype, args.device)
    outcomes, duration = run_naive(model, tokenizer, requests, args.output_len, warmup=1)
    return compute_metrics(outcomes, duration)


def run_roofline(
    model_dir: Path, batches: Sequence[int], dtype: str, device: str = "cpu"
) -> dict[int, float]:
    """Roofline tok/s for each batch size."""
    from textgate.bench.serving.roofline import linear_shapes, measure

    rows = measure(linear_shapes(model_dir), batches, [dtype], repeats=3, device=device)
    return {row.batch: row.tok_per_s for row in rows}


def summary_rows(results: Sequence[RunResult], baselines: Baselines) -> list[list[Any]]:
    """Per level: textgate tok/s, naive tok/s, speedup, latency ratios, roofline fraction."""
    naive = baselines.naive
    rows = []
    for r in results:
        m, c = r.metrics, r.level.concurrency
        roof = baselines.roofline_tok_s.get(c or 0)
        rows.append(
            [
                r.level.label,
                m.output_throughput,
                naive.output_throughput if naive else float("nan"),
                ratio(m.output_throughput, naive.output_throughput) if naive else float("nan"),
                ratio(m.ttft.p50_ms, naive.ttft.p50_ms) if naive else float("nan"),
                ratio(m.tpot.p50_ms, naive.tpot.p50_ms) if naive else float("nan"),
                roof if roof else float("nan"),
                ratio(m.output_throughput, roof) if roof else float("nan"),
            ]
        )
    return rows


SUMMARY_HEADERS = (
    "level",
    "textgate tok/s",
    "naive tok/s",
    "speedup",
    "TTFT p50 ×naive",
    "TPOT p50 ×naive",
    "roofline tok/s",
    "of roofline",
)


def build_parser() -> argparse.ArgumentParser:
    """The command line of the sweep."""
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.serving.sweep", description=__doc__
    )
    parser.add_argument("--url", default=None, help="benchmark this running server instead")
    parser.add_argument("--model-id", default=None, help="passed to the launcher and the baseline")
    parser.add_argument("--launcher-arg", action="append", default=[], help="extra launcher flag")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--backend", default="tgi")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument(
        "--num-requests", type=int, default=None, help="per level (default 2×C, ≥8)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--naive-requests", type=int, default=6)
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--skip-roofline", action="store_true")
    parser.add_argument("--dtype", default="float32", help="naive baseline dtype")
    parser.add_argument(
        "--roofline-dtype",
        default=None,
        help="roofline dtype (default: the served model's, from GET /info; else --dtype)",
    )
    parser.add_argument("--device", default="cpu", help="naive baseline and roofline device")
    parser.add_argument("--threads", type=int, default=None, help="naive/roofline torch threads")
    parser.add_argument("--json-out", default=None, help="append one JSON line per run")
    parser.add_argument("--plot", default=None, help="write a PNG of the sweep")
    add_workload_args(parser)
    parser.set_defaults(input_len=40, output_len=64)
    return parser


def run_sweep(args: argparse.Namespace, server_command: ServerCommand | None = None) -> int:
    """Run the whole sweep; `server_command` overrides how the local server is started."""
    config = BenchConfig(
        workload=spec_from_args(args),
        levels=tuple(LoadLevel(concurrency=c) for c in parse_list(args.concurrency, int)),
        output_len=args.output_len,
        num_requests=args.num_requests,
        warmup=args.warmup,
    )
    if args.url:
        results, tokenizer = _bench(args.url, args, config)
        served = served_dtype(args.url)
    else:
        command = server_command or launcher_command(_launcher_args(args))
        with running_server(command, args.startup_timeout) as url:
            results, tokenizer = _bench(url, args, config)
            served = served_dtype(url)
    model_dir = model_folder(args.model_id)
    roofline_dtype = args.roofline_dtype or served or args.dtype
    baselines = _baselines(model_dir, tokenizer, config, args, roofline_dtype)
    _report(results, baselines, args)
    return 1 if any(r.metrics.failed for r in results) else 0


def _launcher_args(args: argparse.Namespace) -> list[str]:
    model = ["--model-id", args.model_id] if args.model_id else []
    return [*model, *args.launcher_arg]


def model_folder(model_id: str | None) -> Path:
    """The local folder of the served model: a folder as given, else what the launcher uses."""
    if model_id is not None and Path(model_id).is_dir():
        return Path(model_id)
    from textgate.shard_server.loading.model_source import resolve_model

    return resolve_model(model_id)


def _bench(
    url: str, args: argparse.Namespace, config: BenchConfig
) -> tuple[list[RunResult], BenchTokenizer]:
    # The launcher has converted the model by now, so resolving it here is cheap.
    tokenizer = load_tokenizer(args.tokenizer or model_folder(args.model_id))
    target = Target(url, args.backend, None, "textgate")
    return asyncio.run(run_benchmark([target], config, tokenizer)), tokenizer


def served_dtype(url: str) -> str | None:
    """The dtype the server computes in (`model_dtype` of TGI's GET /info), if it says one
    the roofline knows: the engine's ceiling is a matmul pass in that dtype."""
    from textgate.bench.serving.roofline import DTYPES

    try:
        response = httpx.get(f"{url}/info", timeout=10)
        dtype = response.json().get("model_dtype") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return dtype if dtype in DTYPES else None


def _baselines(
    model_dir: Path,
    tokenizer: BenchTokenizer,
    config: BenchConfig,
    args: argparse.Namespace,
    roofline_dtype: str,
) -> Baselines:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    naive = None
    if not args.skip_naive and args.naive_requests > 0:
        # The first level's prompt set: the server's warmup prompts, then its first measured ones.
        prompts = build_requests(config.workload, tokenizer, config.warmup + args.naive_requests)
        naive = run_naive_baseline(model_dir, tokenizer, prompts[config.warmup :], args)
    roofline: dict[int, float] = {}
    batches = [lv.concurrency for lv in config.levels if lv.concurrency is not None]
    if not args.skip_roofline and batches:
        roofline = run_roofline(model_dir, batches, roofline_dtype, args.device)
    return Baselines(naive, roofline, torch.get_num_threads(), roofline_dtype)


def _report(results: Sequence[RunResult], baselines: Baselines, args: argparse.Namespace) -> None:
    print(format_results(results))
    if baselines.naive is not None:
        print()
        print(
            "naive baseline (transformers generate, one request at a time, "
            f"{args.dtype}, {args.device}, {baselines.threads} threads):"
        )
        print(format_metrics([("naive", baselines.naive)]))
    print()
    if baselines.roofline_tok_s:
        print(f"roofline: matmul-only pass over the weights, {baselines.roofline_dtype}")
    print(format_table(SUMMARY_HEADERS, summary_rows(results, baselines)))
    if args.json_out:
        context = {"label": "sweep", "input_len": args.input_len, "output_len": args.output_len}
        records = [result_record(r, context) for r in results]
        if baselines.naive is not None:
            naive_context = {**context, "target": "naive", "concurrency": 1}
            records.append(metrics_record(baselines.naive, naive_context))
        append_json_lines(args.json_out, records)
    if args.plot:
        from textgate.bench.serving.plot import plot_results

        naive = {"naive": baselines.naive} if baselines.naive else {}
        plot_results(results, args.plot, naive)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m textgate.bench.serving.sweep`."""
    return run_sweep(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
