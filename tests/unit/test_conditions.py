"""The AR -> DiT condition split: hand-made id sequences, boundary rules, and the upstream fixture."""

from __future__ import annotations

import pytest
import torch
from dit_reference import config, max_abs, outputs, pipeline

from stage_dit.condition_refiner import SimpleQFormerImageRefiner
from stage_dit.conditions import (
    AnswerBoundaryRule,
    ConditionTokenIds,
    build_condition,
    compute_answer_start_index,
    split_condition_rows,
)

# tiny ids: base vocab < 100, generation ids >= 100; placeholders 90..93
IDS = ConditionTokenIds(gen_vocab_start_index=100, vision_token_ids=(90, 91, 92, 93))


def test_split_excludes_placeholders_and_generation_ids_from_text():
    #            0  1   2   3   4    5  6    7    8    9    10
    ids = torch.tensor([5, 92, 90, 7, 101, 8, 93, 150, 150, 100, 150])
    rows = split_condition_rows(ids, 7, IDS)
    assert rows.text_index.tolist() == [0, 3, 5]  # not 1,2,6 (vision) nor 4 (generation id in the prompt)
    assert rows.image_index.tolist() == [7, 8, 9, 10]


def test_split_image_rows_need_generation_ids_after_the_boundary():
    ids = torch.tensor([1, 2, 3, 150, 4, 151, 91])  # base id 4 and placeholder 91 in the answer are dropped
    rows = split_condition_rows(ids, 3, IDS)
    assert rows.text_index.tolist() == [0, 1, 2]
    assert rows.image_index.tolist() == [3, 5]


def test_split_without_image_rows_is_a_clear_error():
    with pytest.raises(ValueError, match="no image-condition rows"):
        split_condition_rows(torch.tensor([1, 2, 150, 3, 4]), 3, IDS)
    with pytest.raises(ValueError, match="no image-condition rows"):
        split_condition_rows(torch.tensor([1, 2, 3]), 3, IDS)


def test_split_rejects_bad_input():
    with pytest.raises(ValueError):
        split_condition_rows(torch.tensor([[1, 150]]), 1, IDS)
    with pytest.raises(ValueError):
        split_condition_rows(torch.tensor([1, 150]), 3, IDS)
    with pytest.raises(ValueError):
        split_condition_rows(torch.tensor([1, 150]), -1, IDS)


def test_answer_boundary_rules():
    assert compute_answer_start_index(20, 33) == 20
    assert compute_answer_start_index(20, 33, "prompt_length") == 20
    assert compute_answer_start_index(20, 33, AnswerBoundaryRule.LAST_10) == 23
    assert compute_answer_start_index(20, 33, "prompt_minus_10") == 10
    assert compute_answer_start_index(4, 8, "last_10") == 0
    assert compute_answer_start_index(4, 8, "prompt_minus_10") == 0
    with pytest.raises(ValueError, match="prompt_length"):
        compute_answer_start_index(1, 2, "first_5")
    with pytest.raises(ValueError):
        compute_answer_start_index(5, 2)


def test_token_ids_from_config():
    ids = ConditionTokenIds.from_llm_config(config()["llm_config"])
    assert ids == ConditionTokenIds(512, (500, 501, 498, 499))
    # upstream default: gen_vocab_start_index null -> vocab_size; Qwen2.5-VL placeholder defaults
    real = ConditionTokenIds.from_llm_config({"vocab_size": 152064, "gen_vocab_start_index": None})
    assert real == ConditionTokenIds(152064, (151655, 151656, 151652, 151653))
    nested = ConditionTokenIds.from_llm_config({"text_config": {"vocab_size": 7}})
    assert nested.gen_vocab_start_index == 7
    with pytest.raises(ValueError):
        ConditionTokenIds.from_llm_config({})


def test_split_matches_upstream_fixture():
    out = outputs()
    ids = out["cond_input_ids"][0]
    boundary = compute_answer_start_index(32, 33, "last_10")  # the Preview demo's rule over 32 + <|image end|>
    assert boundary == 23
    rows = split_condition_rows(ids, boundary, ConditionTokenIds.from_llm_config(config()["llm_config"]))
    assert torch.equal(rows.text_index, out["cond_text_rows_index"])
    assert torch.equal(rows.image_index, out["cond_image_rows_index"])


@pytest.mark.parametrize(
    ("mode", "key"), [("text_image", "condition_tokens_text_image"), ("image", "condition_tokens_image")]
)
def test_build_condition_matches_upstream(mode, key):
    out = outputs()
    refiner = pipeline().refiner
    with torch.inference_mode():
        condition = build_condition(
            out["cond_last_hidden_states"],
            out["cond_input_ids"][0],
            23,
            token_config=ConditionTokenIds.from_llm_config(config()["llm_config"]),
            refiner=refiner,
            mode=mode,
        )
    assert condition.shape == out[key].shape
    assert max_abs(condition, out[key]) < 1e-4


def test_build_condition_layout_and_errors():
    torch.manual_seed(0)
    refiner = SimpleQFormerImageRefiner(hidden_size=8, num_queries=3, num_layers=1, num_heads=2).eval()
    hidden = torch.randn(7, 8)
    ids = torch.tensor([1, 90, 2, 3, 150, 100, 150])
    with torch.inference_mode():
        both = build_condition(hidden, ids, 4, token_config=IDS, refiner=refiner, mode="text_image")
        image = build_condition(hidden, ids, 4, token_config=IDS, refiner=refiner, mode="image")
        raw = build_condition(hidden, ids, 4, token_config=IDS, refiner=None, mode="text_image")
    assert both.shape == (3 + 3, 8) and image.shape == (3, 8)
    assert torch.equal(both[:3], hidden[[0, 2, 3]])
    assert torch.equal(both[3:], image)
    assert torch.equal(raw, hidden[[0, 2, 3, 4, 5, 6]])
    with pytest.raises(ValueError, match="gen_condition_mode"):
        build_condition(hidden, ids, 4, token_config=IDS, refiner=refiner, mode="text")
    with pytest.raises(ValueError):
        build_condition(hidden[:5], ids, 4, token_config=IDS, refiner=refiner)
    with pytest.raises(ValueError, match="no image-condition rows"):
        build_condition(hidden, torch.tensor([1, 2, 3, 4, 5, 6, 7]), 4, token_config=IDS, refiner=refiner)
