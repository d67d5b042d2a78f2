"""Regenerates the committed gRPC stubs from site.proto.

The stubs are committed so that installing the package needs no code generation; the test
`tests/unit/test_proto_stubs.py` regenerates them into a temp dir and fails if they differ.
Run `make proto` after editing site.proto.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent.parent
PROTO_FILE = PROTO_DIR / "site.proto"
GENERATED = ("site_pb2.py", "site_pb2.pyi", "site_pb2_grpc.py", "site_pb2_grpc.pyi")


def generate_into(out_dir: Path) -> list[Path]:
    """Compiles site.proto into out_dir/fedllm_contract/proto and returns the generated files."""
    proto_include = Path(protoc.__file__).parent / "_proto"
    # mypy-protobuf's plugins are scripts next to this interpreter, which may not be on PATH.
    scripts = Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"--plugin=protoc-gen-mypy={scripts / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={scripts / 'protoc-gen-mypy_grpc'}",
        f"-I{REPO_ROOT}",
        f"-I{proto_include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        str(PROTO_FILE.relative_to(REPO_ROOT)),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")
    target = out_dir / "fedllm_contract" / "proto"
    return [target / name for name in GENERATED]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate_into(Path(tmp)):
            shutil.copyfile(path, PROTO_DIR / path.name)
            print(f"wrote {PROTO_DIR / path.name}", file=sys.stderr)


if __name__ == "__main__":
    main()
