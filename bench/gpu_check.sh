#!/usr/bin/env bash
# bench/gpu_check.sh: everything a session lent a GPU runs, in one go (`make gpu-check`).
#
#   bench/gpu_check.sh prepare   # here, with PyPI: build/gpu-kit (wheels, model files, commit)
#   bench/gpu_check.sh           # there: venv, pytest -m gpu, kernel bench, serving sweep
#   GPU_CHECK_DRY_RUN=1 bench/gpu_check.sh   # on CPU, tiny shapes, the same files
#
# The device machine has no network and a python3 with CUDA torch and triton but not all of
# textgate's dependencies (/work/.library/device/KINDS.md): `prepare` downloads the missing
# pure-Python wheels (the versions of this venv), copies the default model's config and
# tokenizer (its 94 MB of weights cannot travel: the sweep serves a random-weight twin of
# the same shape, which times the same; bench/model_tools/twin.py) and records the commit. Carry
# build/gpu-kit along. The run writes at most 8 files into $OUT (default build/gpu-check):
#   meta.json        GPU, driver, torch, date, commit
#   pytest_gpu.log   pytest -m gpu
#   gpu_kernels.json, gpu_kernels.md   python -m textgate.bench.micro.gpu_kernels (8B shape)
#   sweep.jsonl, sweep.txt             textgate-bench against the served twin
#   launcher.log     the server's log
#   summary.md       all of it as one markdown page (docs/benchmarks.md's GPU section)
# Each step has a time limit and a failed step does not stop the others; the exit status
# is non-zero when any failed.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KIT=${GPU_CHECK_KIT:-$REPO/build/gpu-kit}
OUT=${OUT:-$REPO/build/gpu-check}
DRY=${GPU_CHECK_DRY_RUN:-0}
# Steps to run (all by default): meta pytest kernels sweep.
STEPS=${GPU_CHECK_STEPS:-meta pytest kernels sweep}
# Wheels the device image lacks (KINDS.md's package list) that serving imports.
# grpcio and protobuf travel too: the committed stubs need at least the versions they were
# generated with.
KIT_PACKAGES="starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
  swagger-ui-bundle pytest-asyncio grpcio protobuf importlib-metadata opentelemetry-api
  opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc
  opentelemetry-exporter-otlp-proto-common opentelemetry-proto
  opentelemetry-semantic-conventions googleapis-common-protos"

log() { printf '[gpu-check %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

prepare() {
  local py=${PYTHON:-$REPO/.venv/bin/python}
  mkdir -p "$KIT/wheels" "$KIT/model"
  local specs=()
  for name in $KIT_PACKAGES; do
    local version
    version=$("$py" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
    [ -n "$version" ] && specs+=("$name==$version")
  done
  log "downloading ${specs[*]}"
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$KIT/wheels" "${specs[@]}" || return 1
  local model
  model=$("$py" -c 'from textgate.shard_server.loading.model_source import resolve_model; print(resolve_model(None))') || return 1
  "$py" -m textgate.bench.model_tools.twin "$model" "$KIT/model" --copy-only >/dev/null || return 1
  git -C "$REPO" rev-parse HEAD >"$KIT/COMMIT"
  git -C "$REPO" status --porcelain --untracked-files=no | grep -q . && echo dirty >>"$KIT/COMMIT"
  du -sh "$KIT"
}

setup_python() {
  # Sets PY: the dev venv in a dry run. On the device, the image's python3 (its CUDA torch
  # and triton; it is itself a venv, so a --system-site-packages venv over it would not
  # see them) with the kit's wheels in a --target folder and the repo linked in as
  # `textgate`, both on PYTHONPATH (children, like the shards, inherit it).
  if [ "$DRY" = 1 ]; then
    PY=${PYTHON:-$REPO/.venv/bin/python}
    return 0
  fi
  local site=/tmp/textgate-site
  mkdir -p "$site" && ln -sfn "$REPO" "$site/textgate" || return 1
  if ls "$KIT"/wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade \
      --target "$site" "$KIT"/wheels/*.whl || return 1
  fi
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  PY=python3
  (cd /tmp && "$PY" -c 'import textgate.launcher, textgate.router.server, textgate.shard_server.server')
}

commit() {
  git -C "$REPO" rev-parse HEAD 2>/dev/null || head -c 40 "$KIT/COMMIT" 2>/dev/null || echo unknown
}

step_meta() {
  "$PY" - "$OUT/meta.json" "$(commit)" "$DRY" <<'EOF'
import datetime, json, platform, subprocess, sys
import torch
out, commit, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
meta = {
    "gpu": gpu, "gpu_count": torch.cuda.device_count(),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": commit, "dry_run": dry, "torch": torch.__version__,
    "cuda": torch.version.cuda, "python": platform.python_version(),
}
try:
    import triton
    meta["triton"] = triton.__version__
except ImportError:
    meta["triton"] = None
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    meta["nvidia_smi"] = smi.stdout.strip()
except (OSError, subprocess.SubprocessError):
    meta["nvidia_smi"] = None
open(out, "w").write(json.dumps(meta, indent=2) + "\n")
print(json.dumps(meta))
EOF
}

step_pytest() {
  if [ "$DRY" = 1 ]; then
    echo "pytest -m gpu: not run in a dry run (no GPU: every gpu test would skip)" >"$OUT/pytest_gpu.log"
    return 0
  fi
  # The gpu-marked tests live under these two folders. A module whose imports the image
  # lacks (a dev-only package) is a collection error that must not stop the others.
  (cd "$REPO" && timeout 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    --continue-on-collection-errors tests/kernels tests/shard_server) >"$OUT/pytest_gpu.log" 2>&1
}

step_kernels() {
  local args=(--json "$OUT/gpu_kernels.json" --markdown "$OUT/gpu_kernels.md")
  if [ "$DRY" = 1 ]; then
    args+=(--shape tiny --device cpu --attention torch --batch-sizes 1,4 --context 32 --prefill-tokens 64 --repeats 1)
  fi
  (cd /tmp && timeout 300 "$PY" -m textgate.bench.micro.gpu_kernels "${args[@]}" >/dev/null)
}

step_sweep() {
  local model=/tmp/textgate-gpu-twin source=$KIT/model
  [ -f "$source/config.json" ] || source=$("$PY" -c 'from textgate.shard_server.loading.model_source import resolve_model; print(resolve_model(None))')
  local twin=()
  [ "$DRY" = 1 ] && twin=(--tiny)
  rm -rf "$model"
  "$PY" -m textgate.bench.model_tools.twin "$source" "$model" "${twin[@]}" >/dev/null 2>&1 || return 1
  local port
  port=$("$PY" -c 'from textgate.launcher import free_port; print(free_port())')
  local concurrency=1,8,32 requests=64 input=128 output=128
  [ "$DRY" = 1 ] && concurrency=1,2 requests=4 input=16 output=8
  # From /tmp: the repo root on sys.path would expose its folders (kernels/, router/) as
  # top-level packages.
  (cd /tmp && exec "$PY" -m textgate.launcher --model-id "$model" --hostname 127.0.0.1 \
    --port "$port" --shard-uds-path /tmp/textgate-gpu-shard --max-total-tokens 2048) \
    >"$OUT/launcher.log" 2>&1 &
  local server=$!
  local ready=0
  for _ in $(seq 1 600); do
    if ! kill -0 "$server" 2>/dev/null; then break; fi
    if "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/health', timeout=2).status_code != 200)" 2>/dev/null; then
      ready=1
      break
    fi
    sleep 0.5
  done
  local status=1
  if [ "$ready" = 1 ]; then
    (cd /tmp && timeout 300 "$PY" -c 'import sys; from textgate.bench.serving.cli import main; sys.exit(main())' \
      --url "http://127.0.0.1:$port" \
      --tokenizer "$model" --concurrency "$concurrency" --num-requests "$requests" \
      --input-len "$input" --output-len "$output" --label "gpu-check $(commit)" \
      --json-out "$OUT/sweep.jsonl") >"$OUT/sweep.txt" 2>&1
    status=$?
  else
    echo "the server did not become healthy; see launcher.log" >"$OUT/sweep.txt"
  fi
  kill -TERM "$server" 2>/dev/null
  wait "$server" 2>/dev/null
  return $status
}

summary() {
  {
    echo "# GPU check"
    echo
    echo '```json'
    cat "$OUT/meta.json" 2>/dev/null
    echo '```'
    echo
    echo "Steps: $RESULTS"
    echo
    echo "## Kernel benchmark (python -m textgate.bench.micro.gpu_kernels)"
    echo
    cat "$OUT/gpu_kernels.md" 2>/dev/null || echo "(no result)"
    echo
    echo "## Serving sweep (textgate-bench, default model's random-weight twin)"
    echo
    echo '```'
    cat "$OUT/sweep.txt" 2>/dev/null || echo "(no result)"
    echo '```'
    echo
    echo "## pytest -m gpu (last lines)"
    echo
    echo '```'
    tail -n 15 "$OUT/pytest_gpu.log" 2>/dev/null || echo "(no log)"
    echo '```'
  } >"$OUT/summary.md"
}

main() {
  if [ "${1:-}" = prepare ]; then
    prepare
    return
  fi
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # steps run from /tmp
  RESULTS=""
  local failed=0
  if ! setup_python; then
    log "setting up python failed"
    RESULTS="setup: failed"
    summary
    return 1
  fi
  for step in $STEPS; do
    log "$step"
    local start=$SECONDS
    if "step_$step"; then
      RESULTS+="$step: ok ($((SECONDS - start)) s); "
    else
      RESULTS+="$step: FAILED ($((SECONDS - start)) s); "
      failed=1
    fi
  done
  summary
  log "done: $RESULTS"
  return $failed
}

main "$@"
