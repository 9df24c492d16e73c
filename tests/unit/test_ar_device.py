"""The AR on other dtypes/devices: bf16 on CPU always; CUDA (float32 and bf16) when present.

Self-contained (random tiny weights, tokenizer from `write_tokenizer_files`), so it also runs where
the reference fixture is absent (e.g. the GPU machine).
"""

from __future__ import annotations

import pytest
import torch

from stage_ar.generation import T2ISequence
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM
from stage_ar.sampling import GridConstrainedSampler
from stage_ar.tokenization_mammoth import MammothTokenizer, write_tokenizer_files

HAS_CUDA = torch.cuda.is_available()
W, H = 4, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    ids = write_tokenizer_files(directory, num_visual_tokens=64)
    tok = MammothTokenizer.from_pretrained(directory, base_vocab_size=ids["vocab_size"])
    llm_config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
        "vocab_size": ids["vocab_size"],
        "gen_vocab_size": ids["gen_vocab_size"],
        "extra_gen_vocab": True,
        "gen_vocab_start_index": ids["gen_vocab_start_index"],
        "moe_type": "ffn_attention-1:3",
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    model = MammothARForCausalLM.from_llm_config(llm_config).eval()
    return model, tok


def _sampler(tok, seed):
    return GridConstrainedSampler(
        W,
        H,
        tok.eol_id,
        tok.visual_token_start_id,
        tok.visual_token_end_id,
        1.0,
        16,
        0.95,
        torch.Generator().manual_seed(seed),
    )


def _run(model, tok, seed, **kw):
    seq = T2ISequence(model, tok.encode_t2i_prompt("a lighthouse at dawn", W, H), W, H, _sampler(tok, seed), **kw)
    hidden, ids = seq.run()
    return seq, hidden, ids


def _check_grid(seq, tok):
    assert seq.tokens_sampled == H * (W + 1) + 1 and seq.rows_emitted == seq.total_rows
    for g, t in enumerate(seq.generated_ids + [seq.lookahead_id]):
        ok = t == tok.eol_id if g % (W + 1) == W else tok.visual_token_start_id <= t < tok.visual_token_end_id
        assert ok, (g, t)


def _full(model, ids, device):
    t = torch.tensor([ids], device=device)
    with torch.no_grad():
        return model(t, torch.arange(len(ids), device=device)[None], compute_logits=False).last_hidden_state[0]


def test_bf16_cpu_sequence(setup):
    model, tok = setup
    m16 = MammothARForCausalLM(model.config)
    m16.load_state_dict(model.state_dict())
    m16 = m16.to(torch.bfloat16).eval()
    seq, hidden, ids = _run(m16, tok, seed=1)
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(hidden.float()).all()
    _check_grid(seq, tok)
    torch.testing.assert_close(hidden.float(), _full(m16, ids, "cpu").float(), atol=0.1, rtol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_float32_matches_cpu(setup):
    model, tok = setup
    cpu_seq, cpu_hidden, cpu_ids = _run(model, tok, seed=5)
    gpu_model = MammothARForCausalLM(model.config)
    gpu_model.load_state_dict(model.state_dict())
    gpu_model = gpu_model.cuda().eval()
    gpu_seq, gpu_hidden, gpu_ids = _run(gpu_model, tok, seed=5)
    assert gpu_ids == cpu_ids and gpu_seq.lookahead_id == cpu_seq.lookahead_id  # same seed, same stream
    torch.testing.assert_close(gpu_hidden.cpu(), cpu_hidden, atol=1e-4, rtol=0)
    torch.testing.assert_close(gpu_hidden, _full(gpu_model, gpu_ids, "cuda"), atol=1e-4, rtol=0)
    cfg_seq, cfg_hidden, cfg_ids = _run(gpu_model, tok, seed=5, ar_guidance_scale=3.0)
    _check_grid(cfg_seq, tok)
    torch.testing.assert_close(cfg_hidden, _full(gpu_model, cfg_ids, "cuda"), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_bf16_and_padding_mask(setup):
    model, tok = setup
    m = MammothARForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m = m.to("cuda", torch.bfloat16).eval()
    seq, hidden, ids = _run(m, tok, seed=2)
    _check_grid(seq, tok)
    assert hidden.is_cuda and hidden.dtype == torch.bfloat16 and torch.isfinite(hidden.float()).all()
    torch.testing.assert_close(hidden.float(), _full(m, ids, "cuda").float(), atol=0.1, rtol=0.05)
    # A left-padded row with a key mask equals its unpadded run on the GPU too (masks applied).
    m32 = m.float()
    short = torch.tensor([ids[5:]], device="cuda")
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long, device="cuda"), short], 1)
    mask = torch.ones(1, len(ids), dtype=torch.bool, device="cuda")
    mask[0, :5] = False
    pos = (torch.arange(len(ids), device="cuda") - 5).clamp_min(0)[None]
    with torch.no_grad():
        a = m32(padded, pos, attention_mask=mask).last_hidden_state[0, 5:]
        b = m32(short, torch.arange(short.shape[1], device="cuda")[None]).last_hidden_state[0]
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
