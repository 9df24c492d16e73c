"""Fixtures of the AR unit tests: the reference fixture's AR and a small tokenizer."""

from __future__ import annotations

import json

import pytest
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
