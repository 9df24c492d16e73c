"""Fixtures of the unit tests: the reference fixture's AR, a small tokenizer, and isolation from this
machine (an empty ``HOME`` and cache; no skip but for missing hardware)."""

from __future__ import annotations

import json
import os

import pytest
from isolation import HARDWARE_SKIPS, is_hardware_skip
from reference_fixture import REFERENCE_DIR as FIXTURE
from safetensors.torch import load_file

from stage_ar.modeling_mammoth_ar import MammothARForCausalLM, strip_llm_prefix
from stage_ar.tokenization_mammoth import MammothTokenizer, write_tokenizer_files


@pytest.fixture(scope="module")
def model() -> MammothARForCausalLM:
    cfg = json.loads((FIXTURE / "tiny_config_save_pretrained.json").read_text())["llm_config"]
    m = MammothARForCausalLM.from_llm_config(cfg)
    m.load_state_dict(strip_llm_prefix(load_file(FIXTURE / "tiny_reference.safetensors")), strict=True)
    return m.eval()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> MammothTokenizer:
    directory = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(directory, num_visual_tokens=256)
    return MammothTokenizer.from_pretrained(directory, base_vocab_size=512)


@pytest.fixture(scope="module", autouse=True)
def nothing_from_outside_the_repository(tmp_path_factory):
    """Every unit test runs with an empty ``HOME`` and cache and no ``MAMMOTH_*`` setting, so a test
    that reads a built-in checkpoint or any file from this machine's caches fails here (the full
    proof, ``tests/unit`` in an isolated fresh clone, is the ``slow`` README test)."""
    home = tmp_path_factory.mktemp("unit-home")
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("MAMMOTH_")]:
            mp.delenv(key)
        mp.setenv("HOME", str(home))
        mp.setenv("XDG_CACHE_HOME", str(home / ".cache"))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A unit test may skip only for missing hardware (`isolation.HARDWARE_SKIPS`): any other skip,
    e.g. "fixture data not found", is reported as a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not is_hardware_skip(reason):
            report.outcome = "failed"
            report.longrepr = f"unit tests may skip only for missing hardware {HARDWARE_SKIPS}; skipped: {reason}"
