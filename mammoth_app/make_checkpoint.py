"""``mammoth make-checkpoint``: a small MammothModa2 checkpoint in the real layout.

The files are exactly what a real checkpoint holds (``config.json`` with ``llm_config`` and the
``gen_*`` configs, sharded safetensors with an index and the upstream tensor-name prefixes,
``t2i_generation_config.json``, the tiktoken tokenizer files), filled with deterministic random
weights. Its images are noise; it exists so that the whole pipeline can be run and tested anywhere.

The tensor list is not written by hand: the models are built from the config with our own model
classes, so a checkpoint made here always matches what the loader expects. Weights are drawn, in
sorted-name order from one seeded ``torch.Generator``, the way the reference fixture's harness does:
1-D ``*.weight`` (norm scales) ``1 + 0.1·N(0,1)``, other 1-D ``0.05·N(0,1)``, embedding tables and
the refiner query ``N(0,1)/sqrt(last_dim)``, everything else ``N(0,1)/sqrt(fan_in)``. (Upstream
zero-initialises the DiT modulation and output projections, which would make every velocity 0.)
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import math
import os
import pathlib
import shutil
import tempfile
from typing import Any, Callable

from mammoth_core.checkpoint import BUILTIN_SCHEME, CheckpointError, builtin_folder, resolve_checkpoint

logger = logging.getLogger(__name__)

SHARD_BYTES = 2 * 1024 * 1024  # small shards, so the sharded layout is always exercised


def _tiny_vision_config() -> dict[str, Any]:
    """A tiny vision-tower config (the tower is never loaded, but the config keeps its place)."""
    return {
        "depth": 1,
        "hidden_size": 16,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "in_chans": 3,
        "intermediate_size": 32,
        "window_size": 112,
        "fullatt_block_indexes": [0],
        "tokens_per_second": 4,
    }


def tiny_config(tokens: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.json`` and ``t2i_generation_config.json`` of the built-in ``tiny`` checkpoint.

    Dimensions follow the reference fixture (hidden 64, 4 layers, experts on layers 2-3, DiT hidden
    64 with 2+2 layers, a 16-channel 8x VAE); the vocabulary comes from the tokenizer files written
    beside it (``tokens``, from `stage_ar.tokenization_mammoth.write_tokenizer_files`).
    """
    config = _tiny_model_config(_tiny_llm_config(tokens))
    return config, _tiny_generation_config(tokens)


def _tiny_llm_config(tokens: dict[str, Any]) -> dict[str, Any]:
    """The tiny checkpoint's ``llm_config`` (hidden 64, 4 layers, experts on 2-3; ids from ``tokens``)."""
    return {
        "architectures": ["Mammothmoda2Qwen2_5_VLForConditionalGeneration"],
        "model_type": "mammothmoda2_qwen2_5_vl",
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "max_position_embeddings": 16384,
        "max_window_layers": 4,
        "sliding_window": 16384,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": tokens["vocab_size"],
        "extra_gen_vocab": True,
        "gen_vocab_size": tokens["gen_vocab_size"],
        "gen_vocab_start_index": tokens["gen_vocab_start_index"],
        "moe_type": "ffn_attention-2:4",
        "image_token_id": tokens["image_token_id"],
        "video_token_id": tokens["video_token_id"],
        "vision_start_token_id": tokens["vision_start_token_id"],
        "vision_end_token_id": tokens["vision_end_token_id"],
        "vision_config": _tiny_vision_config(),
    }


def _tiny_model_config(llm: dict[str, Any]) -> dict[str, Any]:
    """The tiny checkpoint's ``config.json`` around ``llm`` (DiT hidden 64 with 2+2 layers, a
    16-channel 8x VAE, a 2-layer condition refiner)."""
    return {
        "architectures": ["Mammothmoda2Model"],
        "model_type": "mammothmoda2",
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "llm_config": llm,
        "gen_axes_dim_rope": [4, 6, 6],
        "gen_axes_lens": [10000, 10000, 10000],
        "gen_condition_mode": "text_image",
        "gen_transport_config": {},
        "gen_dit_config": {
            "_class_name": "Transformer2DModel",
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": None,
            "hidden_size": 64,
            "num_layers": 2,
            "num_refiner_layers": 2,
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "multiple_of": 32,
            "ffn_dim_multiplier": 0.5,
            "norm_eps": 1e-5,
            "axes_dim_rope": [4, 6, 6],
            "axes_lens": [10000, 10000, 10000],
            "text_feat_dim": 64,
            "timestep_scale": 1000.0,
        },
        "gen_image_condition_refiner_config": {
            "num_queries": 8,
            "num_layers": 2,
            "num_heads": 4,
            "norm_eps": 1e-5,
            "dropout": 0.0,
        },
        "gen_vae_config": {
            "_class_name": "AutoencoderKL",
            "act_fn": "silu",
            "block_out_channels": [16, 16, 16, 16],
            "down_block_types": ["DownEncoderBlock2D"] * 4,
            "up_block_types": ["UpDecoderBlock2D"] * 4,
            "force_upcast": True,
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 16,
            "latents_mean": None,
            "latents_std": None,
            "layers_per_block": 1,
            "mid_block_add_attention": True,
            "norm_num_groups": 8,
            "sample_size": 64,
            "scaling_factor": 0.3611,
            "shift_factor": 0.1159,
            "use_post_quant_conv": False,
            "use_quant_conv": False,
        },
    }


def _tiny_generation_config(tokens: dict[str, Any]) -> dict[str, Any]:
    """The tiny checkpoint's ``t2i_generation_config.json`` (grid ids from ``tokens``; sampling off)."""
    return {
        "eol_token_id": tokens["eol_token_id"],
        "visual_token_start_id": tokens["visual_token_start_id"],
        "visual_token_end_id": tokens["visual_token_end_id"],
        "boi_token_id": tokens.get("boi_token_id"),
        "eoi_token_id": tokens.get("eoi_token_id"),
        "image_token_id_gen": tokens.get("image_token_gen_id"),
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "cfg_scale": 0.0,
    }


#: Token ids of the real MammothModa2-Preview tokenizer (MODEL.md; Qwen2.5 base vocabulary).
PREVIEW_TOKENS: dict[str, Any] = {
    "vocab_size": 152064,
    "gen_vocab_start_index": 152064,
    "gen_vocab_size": 32800,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "eol_token_id": 152064,
    "boi_token_id": 152069,
    "eoi_token_id": 152071,
    "visual_token_start_id": 152072,
    "visual_token_end_id": 152072 + 16384,
}


def preview_config() -> tuple[dict[str, Any], dict[str, Any]]:
    """A configuration with MammothModa2-Preview's dimensions, for GPU sizing and benchmarks.

    AR: Qwen2.5-VL-7B text dimensions (hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate
    18944) with generation experts on layers 14..27 (``ffn_attention-14:28``, ~3.3 B parameters: the
    README's "7B + 3B"). DiT: upstream ``Transformer2DModel``'s class defaults (hidden 2304, 26 layers,
    24 heads, 8 KV heads, 2 refiner layers, RoPE axes 32/32/32) (?), FLUX-style 16-channel VAE. Values marked
    (?) in MODEL.md come from config-class defaults, not a real ``config.json``; a mounted real
    checkpoint's own config always wins.
    """
    tokens = dict(PREVIEW_TOKENS)
    config, generation = tiny_config(tokens)
    config["llm_config"].update(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=32768, max_window_layers=28,
        sliding_window=32768, moe_type="ffn_attention-14:28", torch_dtype="bfloat16",
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    )
    config["llm_config"]["vision_config"].update(out_hidden_size=3584)
    config["gen_dit_config"].update(
        hidden_size=2304, num_layers=26, num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8,
        multiple_of=256, ffn_dim_multiplier=None, axes_dim_rope=[32, 32, 32], axes_lens=[300, 512, 512],
        text_feat_dim=3584, timestep_scale=1000.0,
    )
    config["gen_axes_dim_rope"] = [32, 32, 32]
    config["gen_axes_lens"] = [300, 512, 512]
    config["gen_image_condition_refiner_config"].update(num_queries=128, num_layers=2, num_heads=28)
    config["gen_vae_config"].update(
        block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32, sample_size=1024,
    )
    config["gen_condition_mode"] = "image"
    config["torch_dtype"] = "bfloat16"
    return config, generation


PRESETS: dict[str, Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]] = {
    "tiny": tiny_config,
}


def _init_tensor(name: str, tensor: Any, generator: Any) -> Any:
    """Deterministic random values for one parameter (see the module docstring)."""
    import torch

    shape = tuple(tensor.shape)
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * noise if name.endswith("weight") else 0.05 * noise
    if "embed_tokens" in name or name.endswith("query") or "image_index_embedding" in name:
        return noise / math.sqrt(shape[-1])
    fan_in = max(1, tensor[0].numel())
    return noise / math.sqrt(fan_in)


def build_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """The full checkpoint state dict (upstream names) with deterministic random weights."""
    import torch

    from stage_ar.modeling_mammoth_ar import MammothARForCausalLM
    from stage_dit.pipeline import build_dit_modules

    torch.manual_seed(seed)
    ar = MammothARForCausalLM.from_llm_config(config["llm_config"])
    dit = build_dit_modules(config)
    named: dict[str, Any] = {}
    modules = {"llm_model": ar, **dit.named_modules_by_prefix()}
    for prefix, module in modules.items():
        for key, value in module.state_dict().items():
            named[f"{prefix}.{key}"] = value
    generator = torch.Generator().manual_seed(seed + 1234)
    out = {}
    for name in sorted(named):
        value = named[name]
        if value.is_floating_point():
            out[name] = _init_tensor(name, value, generator).contiguous()
        else:
            out[name] = value.clone().contiguous()
    return out


def save_sharded(state: dict[str, Any], folder: pathlib.Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Write ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        os.chmod(folder / fname, 0o644)  # readable like the other files (shared caches, other users)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def make_checkpoint(folder: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> pathlib.Path:
    """Write a complete checkpoint for ``preset`` into ``folder`` (created; must be empty or absent).

    Raises:
        ValueError: unknown preset, or ``folder`` exists and is not empty.
    """
    from stage_ar.tokenization_mammoth import write_tokenizer_files

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    folder = pathlib.Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} exists and is not empty")
    folder.mkdir(parents=True, exist_ok=True)
    tokens = write_tokenizer_files(folder, num_visual_tokens=256)
    config, generation = PRESETS[preset](tokens)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (folder / "t2i_generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True))
    save_sharded(build_state_dict(copy.deepcopy(config), seed=seed), folder)
    logger.debug("wrote %s checkpoint to %s", preset, folder)
    return folder


def ensure_builtin(name: str, cache_dir: pathlib.Path) -> pathlib.Path:
    """The built-in checkpoint ``name`` in ``cache_dir`` (`mammoth_core.checkpoint.builtin_folder`),
    created on first use (process-safe)."""
    target = builtin_folder(name, cache_dir)
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").is_file():
            return target
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            make_checkpoint(tmp / "ckpt", name)
            (tmp / "ckpt" / ".complete").write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp / "ckpt", target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    logger.info("wrote the built-in %s checkpoint to %s", name, target)
    return target


def materialize_checkpoint(uri: str, cache_dir: str | os.PathLike) -> pathlib.Path:
    """`mammoth_core.checkpoint.resolve_checkpoint`, making a ``builtin://NAME`` checkpoint first
    when it is not in ``cache_dir`` yet (the stages only find it there).

    Raises:
        CheckpointError: unknown built-in name or missing folder.
    """
    if uri.startswith(BUILTIN_SCHEME):
        name = uri[len(BUILTIN_SCHEME):]
        if name not in PRESETS:
            raise CheckpointError(uri, [f"unknown built-in checkpoint {name!r}; known: {sorted(PRESETS)}"])
        ensure_builtin(name, pathlib.Path(cache_dir))
    return resolve_checkpoint(uri, cache_dir)
