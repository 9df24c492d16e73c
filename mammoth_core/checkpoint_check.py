"""Checkpoint validation in seconds, without a GPU: the machinery, for any set of components.

A component (the AR's ``llm_model.*``, the DiT's ``gen_*``) says what it needs from a checkpoint in
a `CheckpointPart`: its files, the ``config.json`` sections its models are built from, the
``t2i_generation_config.json`` keys it reads, and a function giving the state-dict shapes of its
models (built on PyTorch's ``meta`` device, so no weight is read or allocated: only the safetensors
headers are, and the values of FP8 row scales, one float per output row). `check_parts` checks, in
order: the files; that the configs have the sections; then every stored tensor under the parts'
prefixes (name, shape, dtype) against those shapes, and that FP8 row scales are finite and > 0. Each stage
runs `verify_parts` on its own part before loading (so the AR never builds the DiT); the whole
checkpoint (``mammoth check-checkpoint``) is all parts, with ``strict_prefixes``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import Callable, Sequence

from mammoth_core.checkpoint import (
    CONFIG_FILE,
    SKIPPED_PREFIXES,
    Checkpoint,
    CheckpointError,
    TensorInfo,
    compare_shapes,
)

#: safetensors dtypes accepted for floating-point weights.
FLOAT_DTYPES = {"BF16", "F16", "F32"}
#: safetensors dtype of FP8 weight codes: accepted only for a ``<name>.weight`` whose ``<name>.weight_scale``
#: the model expects (a checkpoint whose config says it stores FP8, `stage_ar.fp8.stores_fp8`).
FP8_CODES_DTYPE = "F8_E4M3"

#: prefix (with its trailing dot) -> {state-dict key: shape}
Shapes = dict[str, dict[str, tuple[int, ...]]]


@dataclasses.dataclass(frozen=True)
class CheckpointPart:
    """What one component reads from a checkpoint.

    Attributes:
        name: shown in messages (``"AR"``, ``"DiT"``).
        files: file names the folder must hold (``config.json`` is always required).
        config_sections: ``config.json`` keys that must be mappings (the models are built from them).
        generation_keys: ``t2i_generation_config.json`` keys that must be present.
        expected_shapes: ``config.json`` dict -> `Shapes` of the component's models (built on
            ``meta``); any exception it raises is reported as a config that builds no model.
        nonempty_files: files that must not be empty.
    """

    name: str
    files: tuple[str, ...]
    config_sections: tuple[str, ...]
    expected_shapes: Callable[[dict], Shapes]
    generation_keys: tuple[str, ...] = ()
    nonempty_files: tuple[str, ...] = ()


@dataclasses.dataclass
class CheckReport:
    """What `check_parts` found: ``problems`` (empty when fine) and summary counts."""

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

    def add(self, problems: Sequence[str]) -> None:
        """Append ``problems`` not already listed."""
        self.problems += [p for p in problems if p not in self.problems]


def _check_files(path: pathlib.Path, parts: Sequence[CheckpointPart]) -> list[str]:
    if not path.is_dir():
        return ["not a directory"]
    names = dict.fromkeys(f for part in parts for f in (CONFIG_FILE, *part.files))
    return [f"missing file {name}" for name in names if not (path / name).is_file()]


def _expected(ckpt: Checkpoint, parts: Sequence[CheckpointPart], report: CheckReport) -> Shapes | None:
    """The parts' expected shapes, or None (problems reported) when the configs cannot give them."""
    sections = dict.fromkeys(s for part in parts for s in part.config_sections)
    missing = [f"config.json: missing or invalid {s!r}" for s in sections if not isinstance(ckpt.config.get(s), dict)]
    report.add(missing)
    if missing:
        return None
    shapes: Shapes = {}
    for part in parts:
        try:
            shapes.update(part.expected_shapes(ckpt.config))
        except Exception as exc:  # noqa: BLE001 - a config our classes cannot build is a finding
            report.add([f"config.json does not describe a buildable model: {type(exc).__name__}: {exc}"])
            return None
    return shapes


def _check_tensors(prefix: str, expected: dict[str, tuple[int, ...]], infos: dict[str, TensorInfo],
                   report: CheckReport) -> None:
    stored = {n[len(prefix):]: info for n, info in infos.items()
              if n.startswith(prefix) and not n.startswith(SKIPPED_PREFIXES)}
    report.add(compare_shapes(expected, stored, prefix))
    for key, info in stored.items():
        report.tensors_checked += 1
        n = 1
        for d in info.shape:
            n *= d
        report.parameters += n
        report.dtypes[info.dtype] = report.dtypes.get(info.dtype, 0) + 1
        if key not in expected:
            continue
        if key.endswith(".weight") and f"{key}_scale" in expected:  # codes beside their row scales
            if info.dtype != FP8_CODES_DTYPE:
                report.add([f"tensor {prefix}{key} has dtype {info.dtype}; the checkpoint's quantization_config "
                            f"stores it as {FP8_CODES_DTYPE} codes beside {prefix}{key}_scale"])
        elif info.dtype not in FLOAT_DTYPES:
            report.add([f"tensor {prefix}{key} has dtype {info.dtype}; expected one of {sorted(FLOAT_DTYPES)}"])


def _check_row_scales(ckpt: Checkpoint, prefix: str, expected: dict[str, tuple[int, ...]],
                      infos: dict[str, TensorInfo], report: CheckReport) -> None:
    """Report FP8 row scales (``<name>.weight_scale`` beside expected ``<name>.weight`` codes) holding a
    value that is not finite and > 0: the codes times such a scale are not the weight. Reads (and
    imports torch for) nothing where there are no row scales."""
    by_file: dict[str, list[str]] = {}
    for key in expected:
        name = f"{prefix}{key}_scale"
        if key.endswith(".weight") and f"{key}_scale" in expected and name in infos \
                and infos[name].dtype in FLOAT_DTYPES:
            by_file.setdefault(infos[name].file, []).append(name)
    if not by_file:
        return
    import torch
    from safetensors import safe_open

    for file, names in sorted(by_file.items()):
        try:
            with safe_open(str(ckpt.path / file), framework="pt") as handle:
                for name in names:
                    scale = handle.get_tensor(name).float()
                    bad = (~(torch.isfinite(scale) & (scale > 0))).nonzero().flatten()
                    if len(bad):
                        row = int(bad[0])
                        report.add([f"tensor {name} holds {len(bad)} row scale(s) that are not finite and > 0 "
                                    f"(row {row}: {float(scale[row])})"])
        except Exception as exc:  # noqa: BLE001 - a shard that cannot be read is a finding, not a crash
            report.add([f"shard {file} is unreadable: {' '.join(str(exc).split())[:200]}"])


def check_parts(path: str | os.PathLike, parts: Sequence[CheckpointPart], *,
                strict_prefixes: bool = False) -> CheckReport:
    """Validate the checkpoint folder ``path`` for ``parts``; never raises for a bad checkpoint.

    Only tensors under the parts' prefixes are looked at, unless ``strict_prefixes``: then a tensor
    under no part's prefix (nor a skipped one, the vision tower) is a problem too.
    """
    t0 = time.perf_counter()
    report = CheckReport(path=str(path))
    try:
        report.add(_check_files(pathlib.Path(path), parts))
        ckpt = Checkpoint(path)
    except CheckpointError as exc:
        report.add(exc.problems)
        report.seconds = time.perf_counter() - t0
        return report
    shapes = _expected(ckpt, parts, report)
    if shapes is not None:
        infos: dict[str, TensorInfo] = {}
        for prefix in (("",) if strict_prefixes else tuple(shapes)):
            infos.update(ckpt.tensor_infos(prefix, problems=report.problems))
        if strict_prefixes:
            known = tuple(shapes) + SKIPPED_PREFIXES
            report.add([f"unexpected tensor {n} (no component has this prefix)"
                        for n in sorted(infos) if not n.startswith(known)])
        for prefix, expected in shapes.items():
            _check_tensors(prefix, expected, infos, report)
            _check_row_scales(ckpt, prefix, expected, infos, report)
        for key in dict.fromkeys(k for part in parts for k in part.generation_keys):
            if key not in ckpt.generation_config:
                report.add([f"t2i_generation_config.json: missing {key!r}"])
        for name in dict.fromkeys(f for part in parts for f in part.nonempty_files):
            file = pathlib.Path(path) / name
            if file.is_file() and file.stat().st_size == 0:
                report.add([f"{name} is empty"])
    report.seconds = time.perf_counter() - t0
    return report


def verify_parts(path: str | os.PathLike, parts: Sequence[CheckpointPart]) -> CheckReport:
    """Run `check_parts` before a stage loads weights; raise when anything is wrong.

    Raises:
        CheckpointError: with every problem of the report (files, configs, tensor names/shapes/dtypes,
            FP8 row scales not finite and > 0).
    """
    report = check_parts(path, parts)
    if not report.ok:
        raise CheckpointError(path, report.problems)
    return report
