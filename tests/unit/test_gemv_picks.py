"""Pinned GEMV picks (`stage_ar.gemv.pinned_picks`, `stage_ar.gemv_configs.load_picks`): a picks file
fixes which candidate each GEMV variant launches with, so every process on a GPU runs the same configs
instead of what its own short timing at start-up chose."""

from __future__ import annotations

import json

import pytest
import torch

from stage_ar import gemv
from stage_ar.gemv_configs import (
    PICKS_VERSION, TUNED_CONFIGS, GemvConfig, load_picks, pick_key, shipped_picks_path,
)


def _meta(**kw):
    return {"N": 4608, "K": 3584, "BLOCK_K": 128, "NORM": False, "FP8": False, "SWIGLU": False, "SPLIT_K": 1} | kw


def test_pick_key_names_the_shape_flags_and_dtypes_not_the_rows():
    key = pick_key(_meta(), torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert key.startswith("N=4608,K=3584,BLOCK_K=128,NORM=0,FP8=0,SWIGLU=0,SPLIT_K=1")
    assert key.endswith("x=bfloat16,w=bfloat16,out=bfloat16")
    assert not any(part.startswith("M=") for part in key.split(","))
    assert pick_key(_meta(N=3584), torch.bfloat16, torch.bfloat16, torch.bfloat16) != key
    assert pick_key(_meta(SWIGLU=True), torch.bfloat16, torch.bfloat16, torch.bfloat16) != key
    assert pick_key(_meta(), torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16) != key


def test_load_picks_reads_a_file_and_refuses_what_is_not_one(tmp_path):
    path = tmp_path / "picks.json"
    path.write_text(json.dumps({"version": PICKS_VERSION, "device": "X", "picks": {"a": [32, 4, 6], "b": [64, 4, 4]}}))
    assert load_picks(str(path)) == {"a": GemvConfig(32, 4, 6), "b": GemvConfig(64, 4, 4)}
    path.write_text(json.dumps({"version": PICKS_VERSION + 1, "picks": {}}))
    with pytest.raises(ValueError, match="not a GEMV picks file"):
        load_picks(str(path))
    path.write_text(json.dumps({"version": PICKS_VERSION, "picks": {"a": [32, 4]}}))
    with pytest.raises(ValueError, match="pick 'a' must be"):
        load_picks(str(path))
    with pytest.raises(OSError):
        load_picks(str(tmp_path / "missing.json"))


def test_shipped_picks_live_beside_the_module_under_the_gpu_name():
    path = shipped_picks_path("NVIDIA H200")
    assert path.endswith("stage_ar/gemv_picks/NVIDIA_H200.json")
    assert shipped_picks_path("NVIDIA H100 80GB HBM3").endswith("NVIDIA_H100_80GB_HBM3.json")


def test_every_shipped_picks_file_parses_and_picks_only_candidates():
    import pathlib

    folder = pathlib.Path(shipped_picks_path("x")).parent
    from stage_ar.gemv_configs import FP8_TUNED_CONFIGS, W8A8_TUNED_CONFIGS

    candidates = set(TUNED_CONFIGS) | set(FP8_TUNED_CONFIGS) | set(W8A8_TUNED_CONFIGS)
    for path in sorted(folder.glob("*.json")):
        picks = load_picks(str(path))
        assert picks, path
        assert set(picks.values()) <= candidates, path


def test_pinned_picks_off_cuda_are_none():
    assert gemv.pinned_picks(torch.device("cpu")) == {}


@pytest.mark.skipif(not torch.cuda.is_available() or gemv.triton is None, reason="needs CUDA and triton")
def test_a_pinned_pick_launches_without_timing_and_gives_the_timed_launchs_bits(monkeypatch):
    """The pinned candidate runs (not the one timing would choose), no candidate is timed, and the
    output has the bits of the timed launch (every candidate gives the same bits)."""
    torch.manual_seed(0)
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    gemv.forget_tuning()
    monkeypatch.setitem(gemv._PINNED, torch.cuda.current_device(), {})
    timed = gemv.gemv(x, w)
    (key, chosen), = gemv.tuned_picks().items()
    other = next(c for c in TUNED_CONFIGS if [c.block_n, c.num_warps, c.num_stages] != chosen
                 and c.block_n <= 64 and c.num_stages <= 4)
    gemv.forget_tuning()
    monkeypatch.setitem(gemv._PINNED, torch.cuda.current_device(), {key: other})
    pinned = gemv.gemv(x, w)
    assert gemv.last_tuned_config() == GemvConfig(other.block_n, other.num_warps, other.num_stages, split_k=1)
    assert gemv.tuned_picks() == {key: [other.block_n, other.num_warps, other.num_stages]}
    assert all(not tuner.cache for tuner in gemv._TUNERS.values())  # nothing was timed
    assert torch.equal(pinned, timed)
    gemv.forget_tuning()


def test_a_bad_picks_file_fails_the_ar_load_before_any_weight_is_read(tmp_path, monkeypatch, tiny_checkpoint):
    """``MAMMOTH_GEMV_PICKS`` naming a file that is not picks stops `load_ar` with the file's name, where
    it would otherwise surface at the first GEMV launch inside the warm-up (graphs lost, or a failed
    engine) or not at all on a CPU."""
    from mammoth_core.settings import ARSettings
    from stage_ar.loader import load_ar

    bad = tmp_path / "picks.json"
    bad.write_text(json.dumps({"version": PICKS_VERSION, "picks": {"a": "fast"}}))
    monkeypatch.setenv(gemv.PICKS_ENV, str(bad))
    with pytest.raises(ValueError, match=r"MAMMOTH_GEMV_PICKS.*picks.json: pick 'a' must be"):
        load_ar(str(tiny_checkpoint), ARSettings().cache_dir, "cpu", torch.float32)
    monkeypatch.setenv(gemv.PICKS_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(OSError, match=r"MAMMOTH_GEMV_PICKS.*missing.json"):  # the variable that named it
        load_ar(str(tiny_checkpoint), ARSettings().cache_dir, "cpu", torch.float32)
    monkeypatch.delenv(gemv.PICKS_ENV)
    assert load_ar(str(tiny_checkpoint), ARSettings().cache_dir, "cpu", torch.float32).model is not None


@pytest.mark.parametrize("content, words", [
    ("{bad json", "is not JSON"),
    ("", "is not JSON"),
    (b"\xff\xfe\x00", "is not JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not JSON"),  # RecursionError in the decoder
    (json.dumps({"version": True, "picks": {}}), "not a GEMV picks file"),
    (json.dumps({"version": PICKS_VERSION, "picks": {"a": [True, True, True]}}), "pick 'a' must be"),
    ("fifo", "writer did not finish within 0.5 s"),  # a FIFO nothing writes: refused in bounded time
    ("dir", "not a regular file"),
    ("big", "larger than"),
])
def test_a_picks_file_that_is_not_one_is_a_valueerror_naming_the_file(tmp_path, content, words, monkeypatch):
    """(break-it pass, 2026-12-07 night: JSON that did not parse stopped the AR with "Expecting property
    name ..." and no file name; a deeply nested file with a RecursionError traceback; a FIFO hung the
    start where Ctrl-C could not end it; booleans passed as picks.) Every such file is a ValueError that
    names it, and the read never blocks or reads without bound."""
    import os

    from mammoth_core import small_files

    monkeypatch.setattr(small_files, "PIPE_WAIT_S", 0.5)  # the pipe wait, for the FIFO case
    path = tmp_path / "picks.json"
    if content == "fifo":
        os.mkfifo(path)
    elif content == "dir":
        path.mkdir()
    elif content == "big":
        path.write_text(" " * (2 << 20) + "{}")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ValueError) as err:
        load_picks(str(path))
    assert str(path) in str(err.value) and words in str(err.value), str(err.value)
