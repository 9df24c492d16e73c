"""``mammoth check-checkpoint DIR``: validate a mounted checkpoint in seconds, without a GPU.

Checks, in order: the files (configs, tokenizer, safetensors index and shards); that the configs
parse into our model configurations; then every stored tensor's name, shape and dtype against the
models those configs describe. The models are built on PyTorch's ``meta`` device, so no weight is
read or allocated: only the safetensors headers are. The stage images run this before loading.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time

from mammoth_core.checkpoint import (
    AR_PREFIX,
    SKIPPED_PREFIXES,
    Checkpoint,
    CheckpointError,
    check_files,
    compare_shapes,
)

#: safetensors dtypes accepted for floating-point weights.
FLOAT_DTYPES = {"BF16", "F16", "F32"}


@dataclasses.dataclass
class CheckReport:
    """What `check_checkpoint` found: ``problems`` (empty when fine) and summary counts."""

    path: str
    problems: list[str] = dataclasses.field(default_factory=list)
    tensors_checked: int = 0
    parameters: int = 0
    dtypes: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        """A human-readable report; the first line says OK or how many problems."""
        head = (
            f"OK: {self.path}: {self.tensors_checked} tensors, {self.parameters / 1e6:.1f} M parameters, "
            f"dtypes {self.dtypes}, checked in {self.seconds:.2f} s"
            if self.ok
            else f"FAILED: {self.path}: {len(self.problems)} problem(s)"
        )
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])


def expected_shapes(config: dict) -> dict[str, dict[str, tuple[int, ...]]]:
    """Prefix -> {state-dict key: shape} of every component, from models built on ``meta``."""
    import torch

    from stage_ar.modeling_mammoth_ar import MammothARForCausalLM
    from stage_dit.pipeline import build_dit_modules

    with torch.device("meta"):
        ar = MammothARForCausalLM.from_llm_config(config["llm_config"])
        dit = build_dit_modules(config)
    modules = {AR_PREFIX: ar}
    modules.update({f"{prefix}.": m for prefix, m in dit.named_modules_by_prefix().items()})
    return {prefix: {k: tuple(v.shape) for k, v in m.state_dict().items()} for prefix, m in modules.items()}


def check_checkpoint(path: str | os.PathLike) -> CheckReport:
    """Validate the checkpoint folder ``path``; never raises for a bad checkpoint (see the report)."""
    t0 = time.perf_counter()
    report = CheckReport(path=str(path))
    report.problems += check_files(path)
    try:
        ckpt = Checkpoint(path)
    except CheckpointError as exc:
        report.problems += [p for p in exc.problems if p not in report.problems]
        report.seconds = time.perf_counter() - t0
        return report
    config_problems = [
        f"config.json: missing or invalid {key!r}"
        for key in ("llm_config", "gen_dit_config", "gen_vae_config", "gen_image_condition_refiner_config")
        if not isinstance(ckpt.config.get(key), dict)
    ]
    report.problems += config_problems
    if config_problems:
        report.seconds = time.perf_counter() - t0
        return report
    try:
        shapes = expected_shapes(ckpt.config)
    except Exception as exc:  # noqa: BLE001 - a config our classes cannot build is a finding
        report.problems.append(f"config.json does not describe a buildable model: {type(exc).__name__}: {exc}")
        report.seconds = time.perf_counter() - t0
        return report
    infos = ckpt.tensor_infos("", problems=report.problems)
    known_prefixes = tuple(shapes) + SKIPPED_PREFIXES
    for name in sorted(infos):
        if not name.startswith(known_prefixes):
            report.problems.append(f"unexpected tensor {name} (no component has this prefix)")
    for prefix, expected in shapes.items():
        stored = {
            n[len(prefix):]: info
            for n, info in infos.items()
            if n.startswith(prefix) and not n.startswith(SKIPPED_PREFIXES)
        }
        report.problems += compare_shapes(expected, stored, prefix)
        for key, info in stored.items():
            report.tensors_checked += 1
            n = 1
            for d in info.shape:
                n *= d
            report.parameters += n
            report.dtypes[info.dtype] = report.dtypes.get(info.dtype, 0) + 1
            if info.dtype not in FLOAT_DTYPES and key in expected:
                report.problems.append(f"tensor {prefix}{key} has dtype {info.dtype}; expected one of {sorted(FLOAT_DTYPES)}")
    gen = ckpt.generation_config
    for key in ("eol_token_id", "visual_token_start_id", "visual_token_end_id"):
        if key not in gen:
            report.problems.append(f"t2i_generation_config.json: missing {key!r}")
    tok = pathlib.Path(path) / "mammothu.tiktoken"
    if tok.is_file() and tok.stat().st_size == 0:
        report.problems.append("mammothu.tiktoken is empty")
    report.seconds = time.perf_counter() - t0
    return report


def verify_checkpoint(path: str | os.PathLike) -> CheckReport:
    """Run `check_checkpoint` before a stage loads weights; raise when anything is wrong.

    Raises:
        CheckpointError: with every problem of the report (files, configs, tensor names/shapes/dtypes).
    """
    report = check_checkpoint(path)
    if not report.ok:
        raise CheckpointError(path, report.problems)
    return report
