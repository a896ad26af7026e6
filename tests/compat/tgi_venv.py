"""A separate virtualenv holding TGI's own client, `text-generation==0.7.0`.

That client pins `huggingface-hub<1.0`, which cannot live beside transformers 5 in the
project venv, so it gets its own venv (`.venv-compat/` at the repository root, git-ignored).
`run_check` drives `tgi_client_check.py` with that venv's python against a running server.

By hand: `python tests/compat/tgi_venv.py http://127.0.0.1:8080`.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

TGI_CLIENT_SPEC = "text-generation==0.7.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-compat"
CHECK_SCRIPT = Path(__file__).resolve().with_name("tgi_client_check.py")
# Written only after a successful install, so a half-built venv is rebuilt, not reused.
_STAMP = ".textgate-" + TGI_CLIENT_SPEC.replace("==", "-")


def venv_python(venv_dir: Path = DEFAULT_VENV) -> Path:
    """Path of the interpreter inside `venv_dir`."""
    return venv_dir / "bin" / "python"


def ensure_venv(venv_dir: Path = DEFAULT_VENV, *, timeout_s: float = 600.0) -> Path:
    """Create (or reuse) the venv holding `text-generation==0.7.0`; return its python.

    Safe to call from several processes at once: creation is serialised by a file lock.
    Raises `subprocess.CalledProcessError` when venv creation or pip fails (e.g. offline).
    """
    venv_dir.mkdir(parents=True, exist_ok=True)
    with open(venv_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = venv_python(venv_dir)
        if (venv_dir / _STAMP).exists() and python.exists():
            return python
        subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True, timeout=timeout_s)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, TGI_CLIENT_SPEC], check=True, timeout=timeout_s)
        (venv_dir / _STAMP).touch()
        return python


def run_check(base_url: str, venv_dir: Path = DEFAULT_VENV, *, timeout_s: float = 300.0) -> dict:
    """Run `tgi_client_check.py` against `base_url` with TGI's client; return its JSON report.

    The report maps each check name to `{"ok": bool, ...}`; `report["ok"]` is True when all
    passed. Raises `RuntimeError` when the script crashes instead of reporting.
    """
    python = ensure_venv(venv_dir)
    proc = subprocess.run(
        [str(python), str(CHECK_SCRIPT), base_url],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as err:
        raise RuntimeError(
            f"tgi_client_check.py exited {proc.returncode} without a JSON report:\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        ) from err


def main(argv: list[str]) -> int:
    """CLI: print the check report for the base URL given as the only argument."""
    if len(argv) != 1:
        print("usage: tgi_venv.py BASE_URL", file=sys.stderr)
        return 2
    report = run_check(argv[0])
    print(json.dumps(report, indent=2))
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
