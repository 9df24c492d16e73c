"""Test helper: the tiny MammothModa2 reference fixture, loaded for the DiT-side tests.

The fixture (`reference_fixture.REFERENCE_DIR`, inside the repository under `tests/fixtures/`) holds a tiny
checkpoint and the outputs the unmodified upstream code computed from it (float32, CPU).
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch
from safetensors.torch import load_file

from stage_dit.pipeline import DiTModules, MammothDiTPipeline, build_dit_modules

from reference_fixture import REFERENCE_DIR as FIXTURE_DIR



@lru_cache(maxsize=1)
def config() -> dict:
    """The checkpoint `config.json` as `save_pretrained` writes it."""
    return json.loads((FIXTURE_DIR / "tiny_config_save_pretrained.json").read_text())


@lru_cache(maxsize=1)
def weights() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE_DIR / "tiny_reference.safetensors")


@lru_cache(maxsize=1)
def outputs() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE_DIR / "tiny_outputs.safetensors")


def load_strict(modules: DiTModules) -> dict[str, tuple[list[str], list[str]]]:
    """Load every `gen_*` slice with a strict `load_state_dict`; returns `{prefix: (missing, unexpected)}`."""
    report = {}
    for prefix, module in modules.named_modules_by_prefix().items():
        state = {k[len(prefix) + 1 :]: v for k, v in weights().items() if k.startswith(prefix + ".")}
        result = module.load_state_dict(state, strict=True)
        report[prefix] = (list(result.missing_keys), list(result.unexpected_keys))
    return report


def pipeline(dtype: torch.dtype = torch.float32, device: str = "cpu") -> MammothDiTPipeline:
    """A `MammothDiTPipeline` with the fixture weights."""
    modules = build_dit_modules(config(), device=device, dtype=dtype)
    load_strict(modules)
    return MammothDiTPipeline(modules, config(), device=device, dtype=dtype)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()
