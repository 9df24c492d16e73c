"""The MammothModa2 checkpoint format: configs, sharded safetensors, strict loading.

A checkpoint is one folder (the layout upstream's ``save_pretrained`` writes):

- ``config.json``: ``model_type: mammothmoda2``; ``llm_config`` (flat Qwen2.5-VL text fields plus
  the MammothModa generation fields); ``gen_dit_config``, ``gen_vae_config``,
  ``gen_image_condition_refiner_config``, ``gen_axes_dim_rope``, ``gen_axes_lens``,
  ``gen_condition_mode``, ``gen_transport_config``;
- ``model.safetensors.index.json`` + ``model-0000N-of-0000M.safetensors`` shards (or a single
  ``model.safetensors``), tensor names prefixed ``llm_model.*``, ``gen_transformer.*``,
  ``gen_vae.*``, ``gen_image_condition_refiner.*``;
- ``t2i_generation_config.json``; tokenizer files ``mammothu.tiktoken`` and
  ``mammothu_vision_tokens.txt``.

Tensors are memory-mapped (``safetensors.safe_open``), each read once and copied straight into the
module's parameter on its device/dtype. The vision tower (``llm_model.model.visual.*``) is never
read: text-to-image does not use it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from collections import defaultdict
from typing import Any, Iterable, Mapping

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "t2i_generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("mammothu.tiktoken", "mammothu_vision_tokens.txt")

#: Prefix of each component inside the checkpoint.
AR_PREFIX = "llm_model."
DIT_PREFIX = "gen_transformer."
VAE_PREFIX = "gen_vae."
REFINER_PREFIX = "gen_image_condition_refiner."
#: Never loaded: the vision tower is unused for text-to-image.
SKIPPED_PREFIXES = ("llm_model.model.visual.",)

BUILTIN_SCHEME = "builtin://"
#: Bump when the built-in checkpoint's content changes: its cache folder name includes it.
BUILTIN_FORMAT_VERSION = 2


def _is_shard_name(shard: Any) -> bool:
    """Whether ``shard`` (a ``weight_map`` value of the index) names a file in the checkpoint folder
    itself: a non-empty string without path separators, not ``.`` or ``..`` (so not absolute either).
    Anything else would read, and a copy would write, outside the folder."""
    return (isinstance(shard, str) and shard not in ("", ".", "..") and "\0" not in shard
            and not any(sep in shard for sep in (os.sep, os.altsep, "/", "\\") if sep))


class CheckpointError(ValueError):
    """A checkpoint is missing files or has wrong, missing, unexpected or mis-shaped tensors.

    ``problems`` lists every finding, one line each; ``str(err)`` names them all.
    """

    def __init__(self, path: str | os.PathLike, problems: list[str]):
        self.path = str(path)
        self.problems = list(problems)
        shown = "\n  ".join(self.problems[:50])
        more = f"\n  ... and {len(self.problems) - 50} more" if len(self.problems) > 50 else ""
        super().__init__(f"checkpoint {self.path}: {len(self.problems)} problem(s):\n  {shown}{more}")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Name, shape and dtype (safetensors dtype string such as ``BF16``) of one stored tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str


class Checkpoint:
    """An opened checkpoint folder: configs and a name -> shard index; no weights read yet.

    Args:
        path: the checkpoint folder.

    Raises:
        CheckpointError: ``config.json`` or the safetensors files are missing or unreadable; a JSON
            file (``config.json``, ``t2i_generation_config.json``, the index) that does not parse to an
            object, named; an index whose ``weight_map`` places a tensor in a shard that is not a file
            name in the folder (a path with folders, ``..`` or absolute), the entry named.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        problems: list[str] = []
        if not self.path.is_dir():
            raise CheckpointError(self.path, ["not a directory"])
        if not (self.path / CONFIG_FILE).is_file():
            raise CheckpointError(self.path, [f"missing file {CONFIG_FILE}"])
        self.config: dict[str, Any] = self._read_json(CONFIG_FILE)
        self.generation_config: dict[str, Any] = (
            self._read_json(GENERATION_CONFIG_FILE) if (self.path / GENERATION_CONFIG_FILE).is_file() else {}
        )
        self._index = self._read_index(problems)
        if problems:
            raise CheckpointError(self.path, problems)

    def _read_json(self, name: str) -> dict[str, Any]:
        """The JSON object in the folder's file ``name``; a `CheckpointError` naming the file otherwise."""
        try:
            data = json.loads((self.path / name).read_text(encoding="utf-8"))
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(self.path, [f"{name} is not valid JSON: {exc}"]) from None
        except OSError as exc:
            raise CheckpointError(self.path, [f"{name} cannot be read: {exc.strerror or exc}"]) from None
        if not isinstance(data, dict):
            raise CheckpointError(self.path, [f"{name} does not hold a JSON object (it holds a "
                                              f"{type(data).__name__})"])
        return data

    # -- index --------------------------------------------------------------------------------

    def _read_index(self, problems: list[str]) -> dict[str, str]:
        if (self.path / INDEX_FILE).is_file():
            weight_map = self._read_json(INDEX_FILE).get("weight_map", {})
            if not isinstance(weight_map, dict):
                problems.append(f"{INDEX_FILE}: weight_map is not an object of tensor name -> shard file")
                return {}
            outside: dict[str, list[str]] = defaultdict(list)
            for name, shard in weight_map.items():
                if not _is_shard_name(shard):
                    outside[repr(shard)].append(name)
            for shard, names in sorted(outside.items()):
                problems.append(f"{INDEX_FILE}: shard {shard} (of {len(names)} tensor(s), e.g. {min(names)}) "
                                "is not a file name in the checkpoint folder")
            for shard in sorted({s for s in weight_map.values() if _is_shard_name(s)}):
                if not (self.path / shard).is_file():
                    problems.append(f"shard {shard} listed in {INDEX_FILE} is missing")
            return dict(weight_map)
        single = self.path / SINGLE_FILE
        files = [single] if single.is_file() else sorted(self.path.glob("*.safetensors"))
        if not files:
            problems.append(f"no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors files")
            return {}
        from safetensors import safe_open

        mapping: dict[str, str] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for name in handle.keys():
                        mapping[name] = f.name
            except Exception as exc:  # noqa: BLE001 - a corrupt file is a finding, not a crash
                problems.append(f"shard {f.name} is unreadable: {exc}")
        return mapping

    def tensor_names(self) -> list[str]:
        """All stored tensor names, sorted."""
        return sorted(self._index)

    def shard_of(self, name: str) -> str:
        """The safetensors file (relative to the folder) holding tensor ``name``.

        Raises:
            KeyError: no stored tensor has that name.
        """
        return self._index[name]

    def tensor_infos(self, prefix: str = "", problems: list[str] | None = None) -> dict[str, TensorInfo]:
        """Name -> `TensorInfo` for stored tensors starting with ``prefix`` (reads headers only).

        The index and the shard headers must agree under ``prefix``: a shard holding a tensor under
        ``prefix`` that cannot be read, a tensor the index places in a shard that does not hold it,
        or a tensor under ``prefix`` a shard holds that the index does not list, is a problem (what
        other prefixes hold is not looked at). With ``problems`` given they are appended there (and
        the readable tensors returned); otherwise they raise.

        Raises:
            CheckpointError: when ``problems`` is None and anything disagrees.
        """
        from safetensors import safe_open

        found: list[str] = []
        by_file: dict[str, list[str]] = defaultdict(list)
        for name, file in self._index.items():
            if name.startswith(prefix):
                by_file[file].append(name)
        infos: dict[str, TensorInfo] = {}
        for file, names in sorted(by_file.items()):
            try:
                with safe_open(str(self.path / file), framework="pt") as handle:
                    stored = {n for n in handle.keys() if n.startswith(prefix)}
                    for name in names:
                        if name not in stored:
                            found.append(f"tensor {name} is listed in the index for {file} but {file} does not hold it")
                        else:
                            sl = handle.get_slice(name)
                            infos[name] = TensorInfo(name, tuple(sl.get_shape()), sl.get_dtype(), file)
                    for name in sorted(stored - set(names)):
                        found.append(f"tensor {name} is in {file} but not listed in the index")
            except Exception as exc:  # noqa: BLE001 - corrupt or truncated shard
                found.append(f"shard {file} is unreadable: {exc}")
        if found:
            if problems is None:
                raise CheckpointError(self.path, found)
            problems.extend(found)
        return infos

    # -- configs ------------------------------------------------------------------------------

    @property
    def llm_config(self) -> dict[str, Any]:
        """``config.json``'s ``llm_config`` (flat upstream layout)."""
        return dict(self.config.get("llm_config") or {})

    # -- loading ------------------------------------------------------------------------------

    def _load_problems(self, prefix: str, wanted: dict[str, tuple[int, ...]], stored: dict[str, str]) -> list[str]:
        """Every missing, unexpected and mis-shaped tensor of a strict load under ``prefix``
        (``wanted``: the module's state-dict shapes; ``stored``: names minus prefix -> shard file)."""
        problems = [f"missing tensor {prefix}{k}" for k in sorted(set(wanted) - set(stored))]
        problems += [f"unexpected tensor {prefix}{k}" for k in sorted(set(stored) - set(wanted))]
        infos = self.tensor_infos(prefix)  # raises when index and shards disagree
        for key in sorted(set(wanted) & set(stored)):
            got_shape = infos[prefix + key].shape
            if wanted[key] != tuple(got_shape):
                problems.append(
                    f"mis-shaped tensor {prefix}{key}: checkpoint {list(got_shape)}, model expects {list(wanted[key])}"
                )
        return problems

    def load_module(
        self,
        module: Any,
        prefix: str,
        *,
        device: Any = None,
        dtype: Any = None,
        skip_prefixes: Iterable[str] = SKIPPED_PREFIXES,
    ) -> None:
        """Load every tensor under ``prefix`` into ``module`` strictly (state-dict names minus prefix).

        Each tensor is memory-mapped and copied once into the destination parameter/buffer, which is
        first materialised on ``device`` (a module built on the ``meta`` device is allowed).
        Floating-point tensors are cast to ``dtype`` (default: keep the module's dtype); integer
        buffers keep their dtype.

        Raises:
            CheckpointError: naming every missing, unexpected and mis-shaped tensor; nothing is
                loaded in that case.
        """
        import torch
        from safetensors import safe_open

        skip = tuple(skip_prefixes)
        wanted = module.state_dict(keep_vars=True)
        stored = {
            name[len(prefix):]: file
            for name, file in self._index.items()
            if name.startswith(prefix) and not name.startswith(skip)
        }
        problems = self._load_problems(prefix, {k: tuple(v.shape) for k, v in wanted.items()}, stored)
        if problems:
            raise CheckpointError(self.path, problems)

        target_device = torch.device(device) if device is not None else None
        if any(t.is_meta for t in wanted.values()):
            module.to_empty(device=target_device or torch.device("cpu"))
        # nn.Module.to, not diffusers' ModelMixin.to (which warns on every cast).
        elif target_device is not None:
            torch.nn.Module.to(module, device=target_device)
        if dtype is not None:
            torch.nn.Module.to(module, dtype=dtype)
        dest = module.state_dict(keep_vars=True)
        by_file: dict[str, list[str]] = defaultdict(list)
        for key, file in stored.items():
            by_file[file].append(key)
        with torch.no_grad():
            for file, keys in by_file.items():
                with safe_open(str(self.path / file), framework="pt") as handle:
                    for key in keys:
                        tensor = handle.get_tensor(prefix + key)
                        # copy_ converts dtype and moves to the device in one step: no extra
                        # host copy of the memory-mapped tensor.
                        dest[key].data.copy_(tensor)
        logger.info("loaded %d tensors under %r from %s", len(stored), prefix, self.path)


# ------------------------------------------------------------------------------------------------
# Resolution of checkpoint URIs
# ------------------------------------------------------------------------------------------------


def builtin_folder(name: str, cache_dir: str | os.PathLike) -> pathlib.Path:
    """Where the built-in checkpoint ``name`` is cached: ``<cache_dir>/checkpoints/<name>-v<N>``
    (``N``: `BUILTIN_FORMAT_VERSION`); complete once it holds ``.complete``."""
    return pathlib.Path(cache_dir) / "checkpoints" / f"{name}-v{BUILTIN_FORMAT_VERSION}"


def resolve_checkpoint(uri: str, cache_dir: str | os.PathLike) -> pathlib.Path:
    """Turn a checkpoint setting into a folder.

    Args:
        uri: a folder path, ``file:///path``, or ``builtin://NAME``. A built-in checkpoint is made
            by the application layer (`mammoth_app.make_checkpoint.materialize_checkpoint`, which
            the ``mammoth`` command runs before a stage starts); here it is only found in the cache.
        cache_dir: where built-in checkpoints are cached (`builtin_folder`).

    Raises:
        CheckpointError: a built-in checkpoint not made yet, or a missing folder.
    """
    if uri.startswith(BUILTIN_SCHEME):
        folder = builtin_folder(uri[len(BUILTIN_SCHEME):], cache_dir)
        if not (folder / ".complete").is_file():
            raise CheckpointError(uri, [
                f"not made yet in {folder.parent} (the mammoth command makes it on first use: mammoth ar, dit "
                "or up; or make one with mammoth make-checkpoint DIR and pass DIR)"])
        return folder
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    path = pathlib.Path(uri).expanduser()
    if not path.is_dir():
        raise CheckpointError(uri, ["checkpoint folder does not exist"])
    return path


def check_files(path: str | os.PathLike) -> list[str]:
    """Problems with the files of a checkpoint folder (configs and tokenizer), without weights."""
    path = pathlib.Path(path)
    if not path.is_dir():
        return ["not a directory"]
    problems = []
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE, *TOKENIZER_FILES):
        if not (path / name).is_file():
            problems.append(f"missing file {name}")
    return problems


def compare_shapes(
    expected: Mapping[str, tuple[int, ...]], stored: Mapping[str, TensorInfo], prefix: str
) -> list[str]:
    """Missing / unexpected / mis-shaped findings between a model's expected shapes and storage."""
    problems = [f"missing tensor {prefix}{k}" for k in sorted(set(expected) - set(stored))]
    problems += [f"unexpected tensor {prefix}{k}" for k in sorted(set(stored) - set(expected))]
    for k in sorted(set(expected) & set(stored)):
        if tuple(expected[k]) != tuple(stored[k].shape):
            problems.append(
                f"mis-shaped tensor {prefix}{k}: checkpoint {list(stored[k].shape)}, model expects {list(expected[k])}"
            )
    return problems
