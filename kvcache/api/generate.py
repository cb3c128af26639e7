"""Generate the Python stubs of ``protos/kvcache/api/kvcache.proto`` into ``kvcache/api/``.

    python -m kvcache.api.generate [--out DIR]

``--out`` writes them under another root instead (``DIR/kvcache/api/...``), which is how a test
checks that the committed stubs are what the proto file gives.  Needs ``grpcio-tools`` (the
test extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO = "kvcache/api/kvcache.proto"


def generate(out: Path) -> list[Path]:
    """Run ``grpc_tools.protoc`` for the proto file; returns the files written under ``out``."""
    from grpc_tools import protoc  # the test extra; only this generator needs it

    out.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{REPO / 'protos'}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(REPO / "protos" / PROTO),
        ]
    )
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {PROTO} (exit {code})")
    return sorted((out / "kvcache" / "api").glob("kvcache_pb2*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO, help="root to write kvcache/api/ under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
