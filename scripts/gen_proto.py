"""Regenerate the Python stubs for ``proto/`` into ``mammoth_core/pb/``.

Usage: ``python scripts/gen_proto.py`` (needs ``grpcio-tools``). ``--check`` regenerates into a
temporary directory and exits 1 when the committed stubs differ.
"""

from __future__ import annotations

import filecmp
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "proto").rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc for every ``.proto``; returns the generated files (relative to ``out_dir``)."""
    from grpc_tools import protoc

    for proto in PROTOS:
        rel = proto.relative_to(ROOT / "proto")
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(rel),
        ]
        import os

        cwd = os.getcwd()
        os.chdir(ROOT / "proto")
        try:
            if protoc.main(args) != 0:
                raise SystemExit(f"protoc failed for {rel}")
        finally:
            os.chdir(cwd)
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*_pb2*.py*"))


def main() -> int:
    check = "--check" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        files = generate(tmp_path)
        stale = []
        for rel in files:
            dest = ROOT / rel
            if check:
                if not dest.exists() or not filecmp.cmp(tmp_path / rel, dest, shallow=False):
                    stale.append(str(rel))
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(tmp_path / rel, dest)
        if check and stale:
            print("stale generated stubs (run: python scripts/gen_proto.py):", *stale, sep="\n  ")
            return 1
    print("stubs up to date" if check else f"generated {len(files)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
