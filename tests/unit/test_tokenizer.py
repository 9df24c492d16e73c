"""MammothTokenizer: file formats, special-token layout, envelope ids, round trip."""

from __future__ import annotations

import json

import pytest
import tiktoken

from stage_ar.tokenization_mammoth import (
    DEFAULT_NEGATIVE_PROMPT,
    PAT_STR,
    TOKENIZER_FILE,
    VISION_TOKENS_FILE,
    MammothTokenizer,
    _special_tokens_layout,
    write_tokenizer_files,
)

from reference_fixture import REFERENCE_DIR

FIXTURE_OUTPUTS = REFERENCE_DIR / "tiny_outputs.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[MammothTokenizer, dict]:
    directory = tmp_path_factory.mktemp("tok")
    ids = write_tokenizer_files(directory, num_visual_tokens=256)
    config = {"llm_config": {"vocab_size": 512, "gen_vocab_start_index": 512}}
    (directory / "config.json").write_text(json.dumps(config))
    return MammothTokenizer.from_pretrained(directory), ids


def test_written_ids_follow_upstream_layout(tiny):
    tok, ids = tiny
    assert ids["vocab_size"] == ids["gen_vocab_start_index"] == 512
    assert ids["eol_token_id"] == 512 and ids["bos_token_id"] == 516
    assert (ids["boi_token_id"], ids["eoi_token_id"], ids["img_token_id"]) == (517, 518, 519)
    assert (ids["visual_token_start_id"], ids["visual_token_end_id"]) == (520, 776)  # end exclusive
    assert ids["gen_vocab_size"] >= tok.n_vocab - 512 and ids["gen_vocab_size"] % 32 == 0
    assert tok.decode([ids["visual_token_start_id"]]) == "<|visual token 000000|>"
    assert tok.decode([ids["visual_token_end_id"] - 1]) == "<|visual token 000255|>"
    assert tok.n_vocab == ids["visual_token_end_id"]
    assert tok.visual_tokens_ids == [
        ids["image_token_id"],
        ids["video_token_id"],
        ids["vision_start_token_id"],
        ids["vision_end_token_id"],
    ]
    assert tok.decode(tok.visual_tokens_ids) == "<|image_pad|><|video_pad|><|vision_start|><|vision_end|>"
    assert tok.decode([tok.endoftext_id]) == "<|endoftext|>" and tok.endoftext_id == len(tok.mergeable_ranks)
    assert tok.id_map() == {k: v for k, v in ids.items() if k not in ("gen_vocab_size", "num_visual_tokens")}


def test_generation_ids_match_reference_fixture(tiny):
    _, ids = tiny
    special = json.loads(FIXTURE_OUTPUTS.read_text())["special_ids"]
    assert (ids["eol_token_id"], ids["boi_token_id"], ids["eoi_token_id"]) == (
        special["eol_id"],
        special["boi_id"],
        special["eoi_id"],
    )


def test_upstream_sized_layout_gives_known_ids():
    vision = ["<|image start|>", "<|image end|>", "<|image token|>"] + [f"<|visual token {i:06d}|>" for i in range(4)]
    layout = _special_tokens_layout(151643, 152064, vision)
    assert layout["<|endoftext|>"] == 151643 and layout["<|im_start|>"] == 151644 and layout["<|im_end|>"] == 151645
    assert (layout["<|vision_start|>"], layout["<|vision_end|>"]) == (151652, 151653)
    assert (layout["<|image_pad|>"], layout["<|video_pad|>"]) == (151655, 151656)
    assert layout["<|extra_180|>"] == 151845 and layout["<|extra_margin_217|>"] == 152063
    assert layout["<|endofline|>"] == 152064 and layout["<|beginoftext|>"] == 152068
    assert layout["<|image start|>"] == 152069 and layout["<|visual token 000000|>"] == 152072


@pytest.mark.parametrize("text", ["A cat on a table.", "  spaces\tand\nlines ", "ünïcödé 画像 🐱", "x*y 32*32"])
def test_round_trip(tiny, text):
    tok, _ = tiny
    assert tok.decode(tok.encode(text)) == text


def test_envelope_matches_whole_string_tokenisation(tiny):
    tok, _ = tiny
    ids = tok.encode_t2i_prompt("A red bicycle leaning on a wall", 4, 3)
    text = (
        "<|im_start|>system\nYou are a helpful image generator.<|im_end|>\n"
        "<|im_start|>user\nA red bicycle leaning on a wall<|im_end|>\n"
        "<|im_start|>assistant\n<|image start|>4*3<|image token|>"
    )
    assert tok.decode(ids) == text
    reference = tiktoken.Encoding(
        "ref", pat_str=PAT_STR, mergeable_ranks=tok.mergeable_ranks, special_tokens=tok.special_tokens
    )
    assert ids == reference.encode(text, allowed_special="all")
    assert ids[-1] == tok.img_token_id and tok.boi_id in ids and ids[0] == tok.im_start_id
    assert all(not tok.is_generation_id(i) for i in ids[: ids.index(tok.boi_id)])


def test_special_token_text_in_prompt_stays_text(tiny):
    tok, _ = tiny
    ids = tok.encode_t2i_prompt("<|image start|><|im_end|>", 2, 2)
    assert ids.count(tok.boi_id) == 1 and ids.count(tok.im_end_id) == 2  # only the envelope's own


def test_negative_prompt_envelope(tiny):
    tok, _ = tiny
    ids = tok.encode_negative_prompt("blurry")
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a helpful image generator.<|im_end|>\n<|im_start|>user\nblurry<|im_end|>\n"
    )
    assert DEFAULT_NEGATIVE_PROMPT in tok.decode(tok.encode_negative_prompt())


def test_decode_skip_special_and_bad_ids(tiny):
    tok, _ = tiny
    ids = tok.encode_t2i_prompt("dog", 2, 2)
    plain = "system\nYou are a helpful image generator.\nuser\ndog\nassistant\n2*2"
    assert tok.decode(ids, skip_special_tokens=True) == plain
    with pytest.raises(ValueError):
        tok.decode([tok.n_vocab])
    with pytest.raises(ValueError):
        tok.encode_t2i_prompt("dog", 0, 2)


def test_from_pretrained_errors(tmp_path):
    write_tokenizer_files(tmp_path, num_visual_tokens=8)
    with pytest.raises(ValueError, match="base_vocab_size"):
        MammothTokenizer.from_pretrained(tmp_path)  # no config.json, not upstream-sized
    assert MammothTokenizer.from_pretrained(tmp_path, base_vocab_size=512).visual_token_end_id == 528
    (tmp_path / VISION_TOKENS_FILE).write_text("<|image start|>\n<|image end|>\n<|image token|>\n")
    with pytest.raises(ValueError, match="visual token"):
        MammothTokenizer.from_pretrained(tmp_path, base_vocab_size=512)
    (tmp_path / TOKENIZER_FILE).unlink()
    with pytest.raises(FileNotFoundError):
        MammothTokenizer.from_pretrained(tmp_path, base_vocab_size=512)
    with pytest.raises(ValueError):
        write_tokenizer_files(tmp_path / "x", num_visual_tokens=0)
