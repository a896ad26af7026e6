from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from textgate.bench.serving import sweep

FAKE_SERVER_SCRIPT = """
    import sys
    sys.path.insert(0, {tests_dir!r})
    import uvicorn
    from conftest import FakeServer

    uvicorn.run(FakeServer().app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


@pytest.fixture
def fake_server_command(tmp_path):
    script = tmp_path / "fake_server.py"
    source = FAKE_SERVER_SCRIPT.format(tests_dir=str(Path(__file__).parents[1]))
    script.write_text(textwrap.dedent(source))
    return lambda port: [sys.executable, str(script), str(port)]


def test_launcher_command_targets_localhost() -> None:
    argv = sweep.launcher_command(["--model-id", "m"])(1234)
    assert argv[-6:] == ["--hostname", "127.0.0.1", "--port", "1234", "--model-id", "m"]


def test_running_server_waits_for_health_and_stops(fake_server_command) -> None:
    import httpx

    messages: list[str] = []
    with sweep.running_server(fake_server_command, 30, log=messages.append) as url:
        assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")
    log_path = Path(messages[0].split("(output in ")[1].rstrip(")"))
    assert not log_path.exists()  # a clean run leaves no log behind


def test_running_server_passes_its_env_on_top_of_this_process_s(tmp_path) -> None:
    seen = tmp_path / "seen"
    script = (
        "import os, sys; from pathlib import Path; "
        f"Path({str(seen)!r}).write_text(os.environ['BENCH_PEER_VAR'] + ' ' + os.environ['PATH'])"
    )

    def command(port: int) -> list[str]:
        return [sys.executable, "-c", script]

    messages: list[str] = []
    with (
        pytest.raises(sweep.ServerStartError, match="code 0"),
        sweep.running_server(command, 30, log=messages.append, env={"BENCH_PEER_VAR": "x"}),
    ):
        pass
    value, path = seen.read_text().split(" ", 1)
    assert (value, path) == ("x", os.environ["PATH"])
    assert messages[0].startswith("starting: BENCH_PEER_VAR=x ")


def test_a_crashing_server_shows_its_output() -> None:
    def command(port: int) -> list[str]:
        return [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]

    messages: list[str] = []
    with (
        pytest.raises(sweep.ServerStartError, match="code 3") as exc,
        sweep.running_server(command, startup_timeout_s=30, log=messages.append),
    ):
        pass
    assert "no model here" in str(exc.value)
    assert "server output kept in" in messages[-1]


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped() -> None:
    def command(port: int) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    with (
        pytest.raises(sweep.ServerStartError, match="not healthy"),
        sweep.running_server(command, startup_timeout_s=1, log=print),
    ):
        pass


def test_full_sweep_against_a_fake_launcher(
    fake_server_command, tiny_model_dir, tmp_path, capsys
) -> None:
    argv = [
        "--model-id", str(tiny_model_dir),
        "--concurrency", "1,2",
        "--num-requests", "3",
        "--warmup", "1",
        "--naive-requests", "2",
        "--input-len", "8",
        "--output-len", "4",
        "--json-out", str(tmp_path / "sweep.jsonl"),
        "--plot", str(tmp_path / "sweep.png"),
    ]  # fmt: skip
    args = sweep.build_parser().parse_args(argv)
    assert sweep.run_sweep(args, server_command=fake_server_command) == 0
    out = capsys.readouterr().out
    assert "textgate c=1" in out and "textgate c=2" in out
    assert "naive baseline" in out and "speedup" in out and "of roofline" in out
    # The ceiling is timed in the dtype the server says it computes in.
    assert "roofline: matmul-only pass over the weights, bfloat16" in out
    records = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert [r["target"] for r in records] == ["textgate", "textgate", "naive"]
    assert all(r["failed"] == 0 for r in records)
    assert records[-1]["total_output_tokens"] == 2 * 4
    assert (tmp_path / "sweep.png").exists()


def test_model_folder_uses_a_local_folder_as_is(tmp_path) -> None:
    assert sweep.model_folder(str(tmp_path)) == tmp_path


def test_served_dtype_reads_info_and_ignores_what_it_cannot_use(fake_server) -> None:
    url, _ = fake_server
    assert sweep.served_dtype(url) == "bfloat16"
    assert sweep.served_dtype("http://127.0.0.1:9") is None  # nothing listens there
