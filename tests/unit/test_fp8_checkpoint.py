"""FP8 checkpoints (issue 17: "conversion at load time from the bf16 checkpoint, and loading an FP8
checkpoint if present"): ``mammoth quantize-checkpoint`` writes one, the checkpoint check accepts it
and nothing looser, and the AR loads its codes and row scales as they are, with the very tensors the
load-time conversion makes."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tmp_path_factory) -> pathlib.Path:
    """The tiny checkpoint's FP8 copy, written by the real command."""
    dest = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
    proc = subprocess.run([sys.executable, "-m", "mammoth_app.cli", "quantize-checkpoint", str(tiny_checkpoint),
                           str(dest)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(dest)
    return dest


def test_the_copy_stores_exactly_the_visual_token_weights_as_codes_beside_row_scales(tiny_checkpoint, fp8_checkpoint):
    from mammoth_core.checkpoint import Checkpoint
    from stage_ar.fp8 import QUANTIZATION_CONFIG, quantize_fp8_per_channel
    from stage_ar.fp8_checkpoint import fp8_weight_names

    src, dst = Checkpoint(tiny_checkpoint), Checkpoint(fp8_checkpoint)
    names = fp8_weight_names(src.llm_config)
    assert names and any(".gen_mlp.down_proj." in n for n in names) and any(".q_proj." in n for n in names)
    assert dst.llm_config["quantization_config"] == QUANTIZATION_CONFIG
    infos = dst.tensor_infos()
    assert sorted(infos) == sorted(src.tensor_names() + [n + "_scale" for n in names])
    for name in names:
        assert infos[name].dtype == "F8_E4M3" and infos[name + "_scale"].dtype == "F32"
        assert infos[name + "_scale"].shape == (infos[name].shape[0],)
    from safetensors import safe_open

    name = names[0]
    with safe_open(str(tiny_checkpoint / src.shard_of(name)), framework="pt") as h:
        codes, scale = quantize_fp8_per_channel(h.get_tensor(name))
    with safe_open(str(fp8_checkpoint / dst.shard_of(name)), framework="pt") as h:
        assert torch.equal(h.get_tensor(name).view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(h.get_tensor(name + "_scale"), scale)
    untouched = [n for n in src.tensor_names() if n not in set(names)]
    with safe_open(str(tiny_checkpoint / src.shard_of(untouched[0])), framework="pt") as a, \
            safe_open(str(fp8_checkpoint / dst.shard_of(untouched[0])), framework="pt") as b:
        assert torch.equal(a.get_tensor(untouched[0]), b.get_tensor(untouched[0]))
    for f in ("t2i_generation_config.json", "mammothu.tiktoken"):
        assert (fp8_checkpoint / f).read_bytes() == (tiny_checkpoint / f).read_bytes()


def test_the_check_accepts_the_copy_and_refuses_codes_without_their_scales(fp8_checkpoint, tmp_path):
    from mammoth_core.checkpoint_check import check_parts
    from stage_ar.checkpoint_part import CHECKPOINT_PART

    report = check_parts(fp8_checkpoint, [CHECKPOINT_PART])
    assert report.ok, report.problems
    assert report.dtypes.get("F8_E4M3")
    # the same files without the config's quantization_config: codes where weights are expected
    bare = tmp_path / "bare"
    shutil.copytree(fp8_checkpoint, bare)
    config = json.loads((bare / "config.json").read_text())
    del config["llm_config"]["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    problems = check_parts(bare, [CHECKPOINT_PART]).problems
    assert any("unexpected tensor" in p and p.endswith("weight_scale") for p in problems), problems
    assert any("has dtype F8_E4M3" in p for p in problems), problems
    # a quantization_config this AR does not load is named
    config["llm_config"]["quantization_config"] = {"quant_method": "gptq"}
    (bare / "config.json").write_text(json.dumps(config))
    problems = check_parts(bare, [CHECKPOINT_PART]).problems
    assert any("gptq" in p and "quantize-checkpoint" in p for p in problems), problems


@pytest.mark.parametrize("weights_dtype", ["auto", "fp8"])
def test_the_ar_loads_the_codes_as_stored_equal_to_the_load_time_conversion(tiny_checkpoint, fp8_checkpoint,
                                                                              tmp_path, weights_dtype):
    """Every parameter and buffer of the AR loaded from the FP8 copy (``auto`` means ``fp8`` there)
    equals, bit for bit, the AR loaded from the float32 original with ``weights_dtype: fp8``: the same
    model, and the same tokens for any request."""
    from stage_ar.loader import load_ar

    converted = load_ar(str(tiny_checkpoint), str(tmp_path), "cpu", torch.float32, weights_dtype="fp8").model
    loaded = load_ar(str(fp8_checkpoint), str(tmp_path), "cpu", torch.float32, weights_dtype=weights_dtype).model
    want, got = converted.state_dict(), loaded.state_dict()
    assert sorted(want) == sorted(got)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else got[key],
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor), key
    assert all(linear.is_fp8 for linear in loaded.visual_token_linears())


def test_the_command_refuses_a_copy_of_a_copy_and_a_full_destination(fp8_checkpoint, tiny_checkpoint, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mammoth_app.cli", "quantize-checkpoint", *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)

    again = run(str(fp8_checkpoint), str(tmp_path / "again"))
    assert again.returncode == 1 and "stores FP8 weights already" in again.stderr and "Traceback" not in again.stderr
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    refused = run(str(tiny_checkpoint), str(full))
    assert refused.returncode == 1 and "not an empty folder" in refused.stderr, refused.stderr
    assert not (tmp_path / "again").exists() and not (tmp_path / "full.partial").exists()


def test_an_fp8_checkpoint_with_tensor_parallelism_is_refused_before_loading(fp8_checkpoint, tmp_path):
    """The sharder splits weights, not their row scales: refused, naming the way that works."""
    from mammoth_core.distributed import GroupRank
    from stage_ar.loader import load_ar

    with pytest.raises(ValueError, match=r"stores FP8 weights.*tensor-parallel.*weights_dtype 'fp8'"):
        load_ar(str(fp8_checkpoint), str(tmp_path), "cpu", torch.float32, tensor_parallel=GroupRank(0, 2))
