"""The checkpoint format: make-checkpoint layout, strict loading, check-checkpoint reports."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mammoth_app.check_checkpoint import check_checkpoint
from mammoth_core.checkpoint import Checkpoint, CheckpointError
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM
from stage_dit.pipeline import build_dit_modules

from reference_fixture import REFERENCE_DIR as FIXTURE
VISUAL = "llm_model.model.visual."


def _key_layout(d, prefix=""):
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict) and k not in ("id2label", "label2id"):
            out |= _key_layout(v, prefix + k + ".")
    return out


def test_make_checkpoint_matches_fixture_layout(tiny_checkpoint):
    ours = Checkpoint(tiny_checkpoint)
    fixture_keys = set(json.loads((FIXTURE / "tiny_keys.json").read_text()))
    assert set(ours.tensor_names()) == {k for k in fixture_keys if not k.startswith(VISUAL)}
    fixture_cfg = json.loads((FIXTURE / "tiny_config_save_pretrained.json").read_text())
    ours_cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    for section in ("gen_dit_config", "gen_vae_config", "gen_image_condition_refiner_config"):
        assert set(fixture_cfg[section]) <= set(ours_cfg[section]), section
    needed = {"llm_config", "gen_dit_config", "gen_vae_config", "gen_image_condition_refiner_config",
              "gen_axes_dim_rope", "gen_axes_lens", "gen_condition_mode", "gen_transport_config"}
    assert needed <= set(ours_cfg) and needed <= set(fixture_cfg)
    llm_fields = {"hidden_size", "num_hidden_layers", "vocab_size", "gen_vocab_size", "gen_vocab_start_index",
                  "extra_gen_vocab", "moe_type", "image_token_id", "rope_theta", "rms_norm_eps"}
    assert llm_fields <= set(ours_cfg["llm_config"]) and llm_fields <= set(fixture_cfg["llm_config"])
    assert (tiny_checkpoint / "model.safetensors.index.json").is_file()
    assert len({f for f in (tiny_checkpoint).glob("model-*-of-*.safetensors")}) >= 2
    for name in ("t2i_generation_config.json", "mammothu.tiktoken", "mammothu_vision_tokens.txt"):
        assert (tiny_checkpoint / name).is_file()


@pytest.fixture(scope="module")
def fixture_checkpoint(tmp_path_factory) -> pathlib.Path:
    """The reference fixture laid out as a checkpoint folder (single safetensors file)."""
    d = tmp_path_factory.mktemp("fixture-ckpt")
    shutil.copy(FIXTURE / "tiny_config_save_pretrained.json", d / "config.json")
    (d / "model.safetensors").symlink_to(FIXTURE / "tiny_reference.safetensors")
    return d


def test_reference_fixture_loads_with_zero_missing_and_unexpected(fixture_checkpoint):
    ckpt = Checkpoint(fixture_checkpoint)
    ar = MammothARForCausalLM.from_llm_config(ckpt.llm_config)
    ckpt.load_module(ar, "llm_model.")  # strict: raises on any missing/unexpected/mis-shaped tensor
    modules = build_dit_modules(ckpt.config)
    for prefix, module in modules.named_modules_by_prefix().items():
        ckpt.load_module(module, prefix + ".")
    stored = load_file(str(FIXTURE / "tiny_reference.safetensors"))
    key = "llm_model.model.language_model.layers.2.mlp.gate_proj.weight"
    assert torch.equal(ar.state_dict()[key[len("llm_model."):]], stored[key])


def _broken_copy(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(str(dst / shard))
    tensors = edit(tensors)
    save_file(tensors, str(dst / shard))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update({k: shard for k in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _first_key(tensors, prefix):
    return sorted(k for k in tensors if k.startswith(prefix))[0]


@pytest.mark.parametrize("kind", ["renamed", "missing", "misshaped"])
def test_bad_tensor_is_refused_with_its_name(tiny_checkpoint, tmp_path, kind):
    named = {}

    def edit(t):
        key = _first_key(t, "")
        named["key"] = key
        if kind == "renamed":
            t[key.replace(".weight", ".wieght") if key.endswith(".weight") else key + "_x"] = t.pop(key)
        elif kind == "missing":
            t.pop(key)
        else:
            t[key] = torch.zeros(*t[key].shape[:-1], t[key].shape[-1] + 1) if t[key].ndim else torch.zeros(2)
        return t

    broken = _broken_copy(tiny_checkpoint, tmp_path / "broken", edit)
    key = named["key"]
    report = check_checkpoint(broken)
    assert not report.ok
    assert any(key in p for p in report.problems), report.problems
    prefix = key.split(".", 1)[0] + "."
    ckpt = Checkpoint(broken)
    if prefix == "llm_model.":
        module = MammothARForCausalLM.from_llm_config(ckpt.llm_config)
    else:
        module = build_dit_modules(ckpt.config).named_modules_by_prefix()[prefix[:-1]]
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        ckpt.load_module(module, prefix)
    assert report.render().startswith("FAILED:") and key in report.render()  # what the command prints


def test_check_checkpoint_accepts_a_good_one(tiny_checkpoint):
    report = check_checkpoint(tiny_checkpoint)
    assert report.ok, report.problems
    assert report.tensors_checked == len(Checkpoint(tiny_checkpoint).tensor_names())


def _damage(tiny_checkpoint: pathlib.Path, broken: pathlib.Path, damage: str) -> str:
    """Copy ``tiny_checkpoint`` to ``broken`` with its first shard damaged (or a JSON file, or the
    index placing the first shard outside the folder); returns the name the report must give (the
    renamed tensor, the damaged shard's or JSON file, or the index's shard entry as quoted)."""
    shutil.copytree(tiny_checkpoint, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    if damage == "index_only_rename":
        key = sorted(k for k, v in index["weight_map"].items() if v == shard)[0]
        index["weight_map"][key + "_x"] = index["weight_map"].pop(key)
        index_path.write_text(json.dumps(index))
        return key
    if damage.endswith("_not_json"):  # (break-it pass, 2026-12-07: a JSONDecodeError traceback, no file named)
        name = {"index": "model.safetensors.index.json", "generation_config": "t2i_generation_config.json",
                "config": "config.json"}[damage[: -len("_not_json")]]
        (broken / name).write_text("{oops")
        return name
    if damage.startswith("shard_path_"):  # (break-it pass: quantize-checkpoint rewrote such a shard in place)
        outside = broken.parent / "outside.safetensors"
        (broken / shard).rename(outside)
        where = "../outside.safetensors" if damage == "shard_path_relative" else str(outside)
        index["weight_map"] = {k: where if v == shard else v for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index))
        return repr(where)
    if damage == "truncated_shard":
        data = (broken / shard).read_bytes()
        (broken / shard).write_bytes(data[: len(data) // 2])
    else:
        (broken / shard).write_bytes(b"\xff" * 4096)
    return shard


@pytest.mark.parametrize("damage", ["index_only_rename", "truncated_shard", "junk_shard", "index_not_json",
                                    "generation_config_not_json", "config_not_json", "shard_path_relative",
                                    "shard_path_absolute"])
def test_damaged_files_give_a_report_not_a_traceback(tiny_checkpoint, tmp_path, damage):
    """In this process, what ``mammoth check-checkpoint`` runs (an exception here would be the
    command's traceback); the command itself is the next test."""
    expected = _damage(tiny_checkpoint, tmp_path / "broken", damage)
    report = check_checkpoint(tmp_path / "broken")
    assert not report.ok
    assert report.render().startswith("FAILED:") and expected in report.render(), report.render()


def test_the_check_checkpoint_command_reports_a_damaged_file_in_one_report(tiny_checkpoint, tmp_path):
    """The console command end to end: exit status 1, the report on stdout, no traceback."""
    expected = _damage(tiny_checkpoint, tmp_path / "broken", "junk_shard")
    cli = subprocess.run(
        [sys.executable, "-m", "mammoth_app.cli", "check-checkpoint", str(tmp_path / "broken")],
        capture_output=True, text=True, timeout=120,
    )
    assert cli.returncode == 1
    assert cli.stdout.startswith("FAILED:") and expected in cli.stdout, cli.stdout + cli.stderr
    assert "Traceback" not in cli.stderr


def test_missing_folder_is_one_clear_problem(tmp_path):
    report = check_checkpoint(tmp_path / "nope")
    assert report.problems == ["not a directory"]
