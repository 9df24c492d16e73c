"""T2ISequence and GridConstrainedSampler on the reference tiny model (CPU, float32)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from stage_ar.generation import CFG_CONTEXT_TOKENS, T2ISequence
from stage_ar.sampling import GridConstrainedSampler, read_t2i_generation_config
from stage_ar.tokenization_mammoth import MammothTokenizer

from reference_fixture import REFERENCE_DIR as FIXTURE

W, H = 3, 2  # grid: 2 rows of 3 codes + EOL


def make_sampler(tok: MammothTokenizer, seed: int, **kw) -> GridConstrainedSampler:
    gen = torch.Generator().manual_seed(seed)
    params = {"temperature": 1.0, "top_k": None, "top_p": 1.0} | kw
    return GridConstrainedSampler(
        W,
        H,
        tok.eol_id,
        tok.visual_token_start_id,
        tok.visual_token_end_id,
        params["temperature"],
        params["top_k"],
        params["top_p"],
        gen,
    )


def make_sequence(model, tok, seed=0, **kw) -> T2ISequence:
    prompt = tok.encode_t2i_prompt("a small red house", W, H)
    return T2ISequence(model, prompt, W, H, make_sampler(tok, seed), **kw)


def full_forward(model, ids: list[int]) -> torch.Tensor:
    t = torch.tensor([ids])
    with torch.no_grad():
        return model(t, torch.arange(len(ids))[None], compute_logits=False).last_hidden_state[0]


def test_counts_grid_rule_and_row_offsets(model, tokenizer):
    seq = make_sequence(model, tokenizer)
    p = seq.prompt_len
    batches = [seq.prefill()]
    assert batches[0].hidden.shape == (p, 64) and batches[0].row_offset == 0 and not seq.finished
    while not seq.finished:
        batches.append(seq.step())
    grid = H * (W + 1)
    assert seq.tokens_sampled == seq.total_samples == grid + 1
    assert seq.rows_emitted == seq.total_rows == p + grid
    assert sum(len(b) for b in batches) == p + grid
    assert [b.row_offset for b in batches] == [0] + list(range(p, p + grid))
    for g, token in enumerate(seq.generated_ids):
        if g % (W + 1) == W:
            assert token == tokenizer.eol_id
        else:
            assert tokenizer.visual_token_start_id <= token < tokenizer.visual_token_end_id
    assert tokenizer.visual_token_start_id <= seq.lookahead_id < tokenizer.visual_token_end_id  # col 0
    assert seq.kv_cache is None  # freed when finished
    with pytest.raises(RuntimeError):
        seq.step()


def test_rows_equal_teacher_forced_full_forward(model, tokenizer):
    seq = make_sequence(model, tokenizer, seed=3)
    hidden, ids = seq.run()
    assert ids == seq.prompt_ids + seq.generated_ids and hidden.dtype == torch.float32
    torch.testing.assert_close(hidden, full_forward(model, ids), atol=1e-5, rtol=0)


def test_seed_determinism(model, tokenizer):
    runs = [make_sequence(model, tokenizer, seed=s) for s in (7, 7, 8)]
    for r in runs:
        r.run()
    a, b, c = (r.generated_ids + [r.lookahead_id] for r in runs)
    assert a == b
    assert a != c


def test_negative_rows_match_reference(model, tokenizer):
    neg = load_file(FIXTURE / "tiny_outputs.safetensors")
    seq = make_sequence(model, tokenizer, negative_prompt_ids=neg["neg_input_ids"][0].tolist())
    rows = seq.negative_rows()
    assert rows.row_offset == 0 and rows.token_ids == neg["neg_input_ids"][0].tolist()
    torch.testing.assert_close(rows.hidden, neg["neg_condition_tokens"], atol=1e-4, rtol=0)
    with pytest.raises(RuntimeError):
        make_sequence(model, tokenizer).negative_rows()


def test_ar_cfg_matches_explicit_two_branch_reference(model, tokenizer):
    scale = 4.0
    seq = make_sequence(model, tokenizer, seed=11, ar_guidance_scale=scale)
    hidden, ids = seq.run()
    # Emitted rows are the conditional branch only: identical to an unguided teacher-forced forward.
    torch.testing.assert_close(hidden, full_forward(model, ids), atol=1e-5, rtol=0)
    # Re-derive every token: cond logits over the full context, uncond logits over the last 10
    # prompt tokens + generated tokens (positions from 0), mixed as upstream.
    prompt = seq.prompt_ids
    sampler = make_sampler(tokenizer, 11)
    expected: list[int] = []
    with torch.no_grad():
        for g in range(seq.total_samples):
            cond_ids = prompt + expected[:g]
            uncond_ids = prompt[-CFG_CONTEXT_TOKENS:] + expected[:g]
            cond = model(torch.tensor([cond_ids]), torch.arange(len(cond_ids))[None]).logits[0, -1]
            uncond = model(torch.tensor([uncond_ids]), torch.arange(len(uncond_ids))[None]).logits[0, -1]
            expected.append(sampler.sample(uncond + (cond - uncond) * scale, g))
    assert seq.generated_ids + [seq.lookahead_id] == expected


def test_sequence_argument_errors(model, tokenizer):
    with pytest.raises(ValueError):
        T2ISequence(model, [], W, H, make_sampler(tokenizer, 0))
    with pytest.raises(ValueError):
        T2ISequence(model, [1, 2], W + 1, H, make_sampler(tokenizer, 0))
    with pytest.raises(ValueError):
        T2ISequence(model, [1, 2], W, H, make_sampler(tokenizer, 0), dtype=torch.bfloat16)
    seq = make_sequence(model, tokenizer)
    with pytest.raises(RuntimeError):
        seq.step()
    seq.prefill()
    with pytest.raises(RuntimeError):
        seq.prefill()
    seq.release()
    assert seq.finished and seq.kv_cache is None


# ---- sampler ------------------------------------------------------------------------------------


def _sampler(seed=0, **kw) -> GridConstrainedSampler:
    args = {"temperature": 1.0, "top_k": None, "top_p": 1.0} | kw
    return GridConstrainedSampler(
        2, 2, 5, 10, 20, args["temperature"], args["top_k"], args["top_p"], torch.Generator().manual_seed(seed)
    )


def test_sampler_grid_rule_and_range():
    s = _sampler()
    logits = torch.zeros(30)
    logits[5] = 100.0  # EOL strongly preferred, still only allowed at col == ar_width
    logits[25] = 100.0  # outside the visual range: never sampled
    got = [s.sample(logits, g) for g in range(7)]
    assert got[2] == 5 and got[5] == 5
    assert all(10 <= t < 20 for i, t in enumerate(got) if i % 3 != 2)


def test_sampler_greedy_top_k_top_p():
    logits = torch.arange(30, dtype=torch.float32)  # best visual code: 19
    assert _sampler(temperature=0).sample(logits, 0) == 19
    draws = {_sampler(seed=i, top_k=1).sample(logits, 0) for i in range(50)}
    assert draws <= {17, 18, 19} and len(draws) > 1  # top_k keeps at least 3 (upstream)
    draws = {_sampler(seed=i, top_p=0.01).sample(logits, 0) for i in range(50)}
    assert draws <= {17, 18, 19}
    draws = {_sampler(seed=i).sample(torch.zeros(30), 0) for i in range(200)}
    assert draws == set(range(10, 20))  # uniform logits reach every code


@pytest.mark.parametrize("kw", [{"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}])
def test_sampler_rejects_bad_parameters(kw):
    with pytest.raises(ValueError):
        _sampler(**kw)


def test_sampler_rejects_bad_ranges():
    with pytest.raises(ValueError):
        GridConstrainedSampler(2, 2, 12, 10, 20)  # EOL inside the code range
    with pytest.raises(ValueError):
        GridConstrainedSampler(0, 2, 5, 10, 20)
    with pytest.raises(ValueError):
        _sampler().sample(torch.zeros(15), 0)  # logits narrower than the code range


def test_read_t2i_generation_config(tmp_path):
    (tmp_path / "t2i_generation_config.json").write_text(
        json.dumps(
            {
                "eol_token_id": 512,
                "visual_token_start_id": 520,
                "visual_token_end_id": 776,
                "top_k": 2048,
                "temperature": 1.0,
                "do_sample": True,
                "max_new_tokens": 99,
            }
        )
    )
    cfg = read_t2i_generation_config(tmp_path)
    assert (cfg.eol_token_id, cfg.visual_token_start_id, cfg.visual_token_end_id, cfg.top_k) == (512, 520, 776, 2048)
    assert cfg.extra == {"max_new_tokens": 99} and cfg.to_dict()["max_new_tokens"] == 99
    a = GridConstrainedSampler.from_generation_config(cfg, 2, 2, seed=5)
    b = GridConstrainedSampler.from_generation_config(cfg, 2, 2, seed=5, top_k=10)
    assert a.top_k == 2048 and b.top_k == 10
    (tmp_path / "t2i_generation_config.json").write_text(json.dumps({"eol_token_id": 1}))
    with pytest.raises(ValueError, match="visual_token_start_id"):
        read_t2i_generation_config(tmp_path)
