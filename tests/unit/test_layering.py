"""The layering: shared code imports no stage; each stage needs only its own dependencies.

`mammoth_core` is below the stages, the stages are below the application layer (`mammoth_app`: the
CLI, the local runner, the in-process reference, the built-in checkpoint). Checked two ways: the
import statements of `mammoth_core` (static), and real interpreters in which a dependency a
component must not need is made unimportable (a meta-path finder that raises ImportError).
"""

from __future__ import annotations

import ast
import json
import pathlib
import shutil
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABOVE_CORE = ("stage_ar", "stage_dit", "gateway", "mammoth_operator", "mammoth_app")


def _blocked_python(blocked: tuple[str, ...], code: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (repository on the path) where ``blocked`` top-level
    packages raise ImportError on import, as if they were not installed."""
    prelude = textwrap.dedent(f"""
        import sys
        BLOCKED = {blocked!r}
        class _Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is blocked in this test (not installed)")
                return None
        sys.meta_path.insert(0, _Blocker())
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "operator")!r}]
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_mammoth_core_imports_nothing_above_it():
    offenders = []
    for path in sorted((ROOT / "mammoth_core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] in ABOVE_CORE]
    assert offenders == []


def test_the_blocker_really_blocks():
    out = _blocked_python(("diffusers",), "import diffusers")
    assert out.returncode != 0 and "blocked in this test" in out.stderr


def test_the_ar_loads_its_checkpoint_without_diffusers_or_torch_dynamo(tiny_checkpoint):
    """The AR stage verifies and loads the tiny checkpoint on the CPU with diffusers unimportable,
    and without importing torch._dynamo (which arithmetic on ``meta`` tensors pulls in: about 2 s of
    the stage's start-up; `mammoth_core.meta_build`)."""
    out = _blocked_python(("diffusers",), f"""
        import torch
        from stage_ar.loader import load_ar
        bundle = load_ar({str(tiny_checkpoint)!r}, "/nonexistent", "cpu", torch.float32)
        assert "diffusers" not in sys.modules
        print("loaded", type(bundle.model).__name__)
        print("torch._dynamo imported:", "torch._dynamo" in sys.modules)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded MammothARForCausalLM" in out.stdout
    assert "torch._dynamo imported: False" in out.stdout, out.stdout


def _drop_tensor(src: pathlib.Path, dst: pathlib.Path, prefix: str) -> str:
    """Copy ``src`` to ``dst`` with the first tensor under ``prefix`` gone from the index."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = sorted(k for k in index["weight_map"] if k.startswith(prefix))[0]
    del index["weight_map"][key]
    index_path.write_text(json.dumps(index))
    return key


def test_each_stage_checks_only_its_own_prefixes(tiny_checkpoint, tmp_path):
    """A DiT tensor the index lost is the DiT's problem (and check-checkpoint's), not the AR's;
    an AR tensor the index lost is the AR's problem, not the DiT's."""
    import pytest
    import torch

    from mammoth_core.checkpoint import CheckpointError
    from mammoth_core.settings import DiTSettings
    from stage_ar.loader import load_ar
    from stage_dit.loader import load_pipeline

    no_vae = tmp_path / "no_vae"
    vae_key = _drop_tensor(tiny_checkpoint, no_vae, "gen_vae.")
    load_ar(str(no_vae), str(tmp_path), "cpu", torch.float32)  # the AR does not read gen_vae.*
    with pytest.raises(CheckpointError, match=vae_key.replace(".", r"\.")):
        load_pipeline(DiTSettings(checkpoint=str(no_vae), cache_dir=str(tmp_path), device="cpu"))

    no_ar = tmp_path / "no_ar"
    ar_key = _drop_tensor(tiny_checkpoint, no_ar, "llm_model.")
    load_pipeline(DiTSettings(checkpoint=str(no_ar), cache_dir=str(tmp_path), device="cpu"))
    with pytest.raises(CheckpointError, match=ar_key.replace(".", r"\.")):
        load_ar(str(no_ar), str(tmp_path), "cpu", torch.float32)

    # the whole-checkpoint check (mammoth check-checkpoint) still names both
    from mammoth_app.check_checkpoint import check_checkpoint

    for folder, key in ((no_vae, vae_key), (no_ar, ar_key)):
        report = check_checkpoint(folder)
        assert f"missing tensor {key}" in report.problems, report.problems


MODEL_STACK = ("torch", "diffusers", "safetensors", "tiktoken", "triton", "numpy", "PIL")


def test_the_gateway_and_the_operator_import_without_the_model_stack():
    """What the gateway and operator images run (their packages and the `mammoth` command's parser)
    imports with torch, diffusers and the other model dependencies unimportable."""
    out = _blocked_python(MODEL_STACK, """
        import gateway.app, gateway.serving, gateway.api_router
        import mammoth_operator, mammoth_operator.handlers
        from mammoth_app.cli import build_parser
        build_parser().parse_args(["gateway", "--ar", "127.0.0.1:1", "--dit", "127.0.0.1:2"])
        build_parser().parse_args(["operator", "-A"])
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert loaded == [], loaded
        print("ok")
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
