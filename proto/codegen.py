"""Regenerate the committed gRPC stubs from generate.proto.

Run `python -m textgate.proto.codegen`; tests/proto/test_stubs.py fails when the
committed stubs differ from what this produces.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
STUB_NAMES = ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Write the three stub files for generate.proto into out_dir."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_DIR / "generate.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on generate.proto")
        grpc_stub = Path(tmp, "generate_pb2_grpc.py")
        # protoc writes a top-level import; the stubs live in the textgate.proto package.
        grpc_stub.write_text(
            grpc_stub.read_text().replace(
                "import generate_pb2 as generate__pb2",
                "from textgate.proto import generate_pb2 as generate__pb2",
            )
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in STUB_NAMES:
            shutil.copyfile(Path(tmp, name), out_dir / name)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR)
