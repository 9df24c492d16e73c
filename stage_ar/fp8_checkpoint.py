"""Write a copy of a checkpoint whose AR visual-token projections are stored as FP8 (``mammoth
quantize-checkpoint``), so that an AR serving FP8 weights loads codes instead of converting at start.

What changes in the copy (the layout of `stage_ar.fp8`): every weight `MammothARForCausalLM.visual_token_linears`
reads, under its checkpoint name (``llm_model.model.language_model.layers.N.self_attn.q_proj.weight``,
``...gen_mlp.down_proj.weight``, ...), becomes ``F8_E4M3`` codes, with ``<name>_scale`` ``(N,)``
float32 beside it, and ``config.json``'s ``llm_config`` gains ``quantization_config``
(`stage_ar.fp8.QUANTIZATION_CONFIG`). Every other tensor (embeddings, norms, heads, the text experts,
the vision tower, the DiT), the tokenizer and the other files are copied unchanged, shard for shard.

Each weight is quantized alone (`stage_ar.fp8.quantize_fp8_per_channel`: one scale per output row, so
``q_proj``, ``k_proj`` and ``v_proj`` quantized apart give the bits of their stacked ``qkv_proj``),
from the dtype it is stored in: a bf16 checkpoint gives the codes the AR makes at load with
``weights_dtype: fp8`` in bf16, bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
from collections import defaultdict

from mammoth_core.checkpoint import AR_PREFIX, CONFIG_FILE, INDEX_FILE, Checkpoint
from mammoth_core.checkpoint_check import verify_parts
from stage_ar.checkpoint_part import CHECKPOINT_PART, expected_shapes
from stage_ar.fp8 import QUANTIZATION_CONFIG, quantize_fp8_per_channel, stores_fp8

__all__ = ["fp8_weight_names", "partial_folder", "write_fp8_checkpoint"]

logger = logging.getLogger(__name__)

#: Suffix of a weight's row scales beside its codes (``<name>.weight`` -> ``<name>.weight_scale``).
SCALE_SUFFIX = "_scale"
#: The partial folder's name inside an existing destination folder (`partial_folder`).
PARTIAL_NAME = ".quantize-checkpoint.partial"


def fp8_weight_names(llm_config: dict) -> list[str]:
    """The stored names (with the ``llm_model.`` prefix) of the weights a visual token reads, as the
    checkpoint names them (``q_proj``, ``k_proj``, ``v_proj`` apart): those an FP8 checkpoint stores
    as codes, i.e. those whose row scales `stage_ar.checkpoint_part.expected_shapes` expects for the
    FP8 layout. No tensor is allocated (the model is built on ``meta``)."""
    fp8 = {**llm_config, "quantization_config": dict(QUANTIZATION_CONFIG)}
    keys = expected_shapes({"llm_config": fp8})[AR_PREFIX]
    return sorted(AR_PREFIX + k[: -len(SCALE_SUFFIX)] for k in keys if k.endswith(".weight" + SCALE_SUFFIX))


def _refuse_destination(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Raise ValueError for a destination the copy must not be written to (see `write_fp8_checkpoint`)."""
    if dst.is_symlink():
        raise ValueError(f"{dst} is a symbolic link: give a new folder or an empty real one")
    where, source = dst.resolve(), src.resolve()
    if where == source:
        raise ValueError(f"{dst} is the source folder: give another folder")
    if source in where.parents:
        raise ValueError(f"{dst} is inside the source folder {src}: give a folder outside it")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{dst} is a file: give a new folder or an empty one")
    if dst.exists() and any(entry.name != PARTIAL_NAME for entry in dst.iterdir()):  # a partial one: _create_partial
        raise ValueError(f"{dst} exists and is not an empty folder")
    if not dst.parent.is_dir():
        raise ValueError(f"{dst.parent} does not exist: create it first")


def partial_folder(destination: str | os.PathLike) -> pathlib.Path:
    """Where `write_fp8_checkpoint` writes the copy to ``destination`` until it is complete.

    Beside a new folder, ``<destination>.partial``, renamed to ``destination`` at the end; inside an
    existing (empty) folder, the hidden ``<destination>/.quantize-checkpoint.partial``, whose entries are
    moved up into ``destination`` at the end, so that a folder that cannot be removed or renamed (a
    volume's mount point) is filled where it is. A run creates it exclusively and removes only the one
    it created: while it exists, another run to the same destination refuses to start.
    """
    dst = pathlib.Path(os.path.abspath(destination))
    return dst / PARTIAL_NAME if dst.is_dir() else dst.with_name(dst.name + ".partial")


def _create_partial(dst: pathlib.Path) -> pathlib.Path:
    """Create `partial_folder` of ``dst`` (exclusively); ValueError when it exists."""
    partial = partial_folder(dst)
    try:
        partial.mkdir()
    except FileExistsError:
        raise ValueError(f"{partial} exists: another run is writing {dst}, or one was killed (then remove it)") \
            from None
    return partial


def _publish(partial: pathlib.Path, dst: pathlib.Path) -> None:
    """Move the complete copy in ``partial`` (`partial_folder`) to ``dst``: a rename beside it, the entries
    one by one (``os.replace``, same file system) from inside it; on failure, what was moved is removed.

    Raises:
        ValueError: ``dst`` got other entries while the copy was written.
        OSError: a rename failed (``dst`` filled meanwhile by another writer: ENOTEMPTY).
    """
    if partial.parent != dst:
        os.rename(partial, dst)  # also replaces an empty folder made meanwhile; refuses a filled one
        return
    others = sorted(entry.name for entry in dst.iterdir() if entry.name != PARTIAL_NAME)
    if others:
        raise ValueError(f"{dst} got other entries ({', '.join(others[:3])}) while the copy was written")
    moved: list[pathlib.Path] = []
    try:
        for name in sorted(os.listdir(partial)):
            os.replace(partial / name, dst / name)
            moved.append(dst / name)
        partial.rmdir()
    except BaseException:
        for path in moved:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        raise


def write_fp8_checkpoint(source: str | os.PathLike, destination: str | os.PathLike) -> pathlib.Path:
    """Write the FP8 copy of the checkpoint folder ``source`` to ``destination`` (module docstring).

    The copy is written to `partial_folder` (beside a new destination, or inside an existing empty one,
    which is neither removed nor renamed) and moved into place when complete; a failure this code sees,
    or SIGINT (SIGTERM and SIGHUP too under ``mammoth quantize-checkpoint``), removes the partial folder
    (a killed process leaves it, and the next run refuses to start until it is removed). Peak host
    memory: one shard of ``source``.

    Args:
        source: a checkpoint folder the AR can load (checked first, headers only).
        destination: a new folder in an existing one, or an empty folder; not a symbolic link, not
            the source nor inside it.

    Returns:
        ``destination`` as an absolute path.

    Raises:
        mammoth_core.checkpoint.CheckpointError: ``source`` is not a checkpoint the AR loads.
        ValueError: ``source`` is empty or a URI (a folder is needed), stores FP8 weights already, or
            holds a link to a folder (named:
            `_refuse_linked_folders`); a destination refused as above (or its
            partial folder exists: another run's); a shard of ``source`` that cannot be read; a
            visual-token weight holding a non-finite value (named).
        OSError: reading or writing failed (a full disk, say): one line naming ``destination`` and the
            error.
    """
    if not str(source):
        raise ValueError("no source folder given: give a checkpoint folder")
    if "://" in str(source):
        raise ValueError(f"{source} is a URI: quantize-checkpoint takes a checkpoint folder (`mammoth "
                         "make-checkpoint DIR` writes the built-in one, `mammoth download-model URI DIR` a "
                         "hub one; then give DIR)")
    src, dst = pathlib.Path(source), pathlib.Path(os.path.abspath(destination))
    if not src.is_dir():
        raise ValueError(f"{src} does not exist or is not a folder: give a checkpoint folder")
    verify_parts(src, [CHECKPOINT_PART])
    ckpt = Checkpoint(src)
    if stores_fp8(ckpt.llm_config):
        raise ValueError(f"{src} stores FP8 weights already (llm_config.quantization_config)")
    _refuse_linked_folders(src)
    _refuse_destination(src, dst)
    partial = _create_partial(dst)
    try:
        converted = _write(ckpt, src, partial)
        _publish(partial, dst)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)  # this run's own (created above)
        if isinstance(exc, OSError):  # a full disk, say: one line naming the destination
            raise OSError(f"the copy to {dst} failed, nothing left there: {' '.join(str(exc).split())}") from exc
        raise
    logger.info("FP8 checkpoint at %s: %d weights as E4M3 codes with row scales", dst, converted)
    return dst


def _raise(exc: OSError) -> None:
    """``os.walk``'s ``onerror``: a folder that cannot be listed fails the walk instead of being skipped."""
    raise exc


def _refuse_linked_folders(src: pathlib.Path) -> None:
    """Raise ValueError naming the first symbolic link to a folder inside ``src``. The copy follows
    linked files (a Hugging Face snapshot's files are links to its blobs) but not linked folders: one
    pointing above ``src`` made the copy copy every sibling folder into itself, level after level,
    until the file names grew too long (break-it pass, 2026-12-07), which in a models folder fills
    the disk first."""
    for folder, dirs, _files in os.walk(src, onerror=_raise):
        for name in dirs:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                raise ValueError(f"{path} is a symbolic link to a folder: copy that folder into {src} "
                                 "or remove the link (linked files are fine)")


def _copy_contents(src: pathlib.Path, partial: pathlib.Path) -> None:
    """Copy every file of ``src`` but its safetensors shards and index into ``partial`` (existing), folders
    included, contents only: a read-only source's modes (0444 files, a 0555 folder, as a read-only
    volume gives them) would make the copy one this code cannot finish, nor remove."""
    for folder, _dirs, files in os.walk(src, onerror=_raise):  # linked folders: `_refuse_linked_folders`
        here = partial / os.path.relpath(folder, src)
        here.mkdir(exist_ok=True)
        for name in files:
            if not (name.endswith(".safetensors") or name == INDEX_FILE):
                shutil.copyfile(os.path.join(folder, name), here / name)


def _write(ckpt: Checkpoint, src: pathlib.Path, partial: pathlib.Path) -> int:
    """The copy into ``partial`` (created, empty); returns how many weights it stored as codes."""
    import torch
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    names = set(fp8_weight_names(ckpt.llm_config))
    _copy_contents(src, partial)
    config = dict(ckpt.config)
    config["llm_config"] = {**ckpt.llm_config, "quantization_config": dict(QUANTIZATION_CONFIG)}
    (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in ckpt.tensor_names():
        by_file[ckpt.shard_of(name)].append(name)
    weight_map: dict[str, str] = {}
    total = converted = 0
    for file, file_names in sorted(by_file.items()):
        out: dict[str, torch.Tensor] = {}
        try:
            with safe_open(str(src / file), framework="pt") as handle:
                for name in file_names:
                    tensor = handle.get_tensor(name)
                    if name in names:
                        try:
                            out[name], out[name + SCALE_SUFFIX] = quantize_fp8_per_channel(tensor)
                        except ValueError as exc:
                            raise ValueError(f"{src / file}: {name}: {exc}") from None
                        converted += 1
                    else:
                        out[name] = tensor.contiguous()
        except SafetensorError as exc:
            raise ValueError(f"{src / file} cannot be read: {' '.join(str(exc).split())[:200]}") from None
        try:
            save_file(out, str(partial / file), metadata={"format": "pt"})
        except SafetensorError as exc:  # I/O errors (ENOSPC, EFBIG) come as this
            raise OSError(f"{file} cannot be written: {' '.join(str(exc).split())[:200]}") from None
        os.chmod(partial / file, 0o644)
        for name, tensor in out.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
        logger.info("wrote %s (%d tensors)", file, len(out))
    if converted != len(names):
        raise ValueError(f"{src}: {len(names) - converted} of the {len(names)} visual-token weights were not found")
    if (src / INDEX_FILE).is_file() or len(by_file) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (partial / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return converted
