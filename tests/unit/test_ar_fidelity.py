"""The AR model against the upstream reference fixture (float32, CPU, max-abs 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from stage_ar.configuration_mammoth_ar import MammothARConfig, parse_moe_type
from stage_ar.kv_pool import KVCache
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM, strip_llm_prefix

from reference_fixture import REFERENCE_DIR as FIXTURE


ATOL = 1e-4


@pytest.fixture(scope="module")
def llm_config() -> dict:
    return json.loads((FIXTURE / "tiny_config_save_pretrained.json").read_text())["llm_config"]


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "tiny_outputs.safetensors")


@pytest.fixture(scope="module")
def model(llm_config) -> MammothARForCausalLM:
    torch.manual_seed(0)
    m = MammothARForCausalLM.from_llm_config(llm_config)
    result = m.load_state_dict(strip_llm_prefix(load_file(FIXTURE / "tiny_reference.safetensors")), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return m.eval()


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand(ids.shape[0], -1)


def test_config_reads_flat_and_nested_layouts(llm_config):
    flat = {k: v for k, v in llm_config.items() if k != "text_config"}
    a = MammothARConfig.from_dict(flat)
    b = MammothARConfig.from_dict(llm_config)
    nested_only = {"text_config": llm_config["text_config"], "image_token_id": 500}
    c = MammothARConfig.from_dict(nested_only)
    for cfg in (a, b, c):
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (64, 4, 2)
        assert (cfg.vocab_size, cfg.gen_vocab_start_index, cfg.gen_vocab_size) == (512, 512, 300)
        assert cfg.attention_expert_layers == (2, 3) and cfg.ffn_expert_layers == (2, 3)
        assert cfg.full_vocab_size == 812
    assert (b.image_token_id, b.video_token_id, b.vision_start_token_id, b.vision_end_token_id) == (500, 501, 498, 499)
    no_start = dict(flat, gen_vocab_start_index=None)
    assert MammothARConfig.from_dict(no_start).gen_vocab_start_index == 512


@pytest.mark.parametrize(
    ("moe_type", "attention", "ffn"),
    [
        ("none", (), ()),
        ("ffn", (), (0, 1, 2, 3)),
        ("attention-1:3", (1, 2), ()),
        ("ffn-0:1", (), (0,)),
        ("ffn_attention-2:4", (2, 3), (2, 3)),
    ],
)
def test_parse_moe_type(moe_type, attention, ffn):
    got_attention, got_ffn = parse_moe_type(moe_type, 4)
    assert (got_attention, got_ffn) == (attention, ffn)


@pytest.mark.parametrize("bad", ["mlp", "ffn-3:1", "ffn_attention-14", ""])
def test_parse_moe_type_rejects(bad):
    with pytest.raises(ValueError):
        parse_moe_type(bad, 4)


def test_keys_and_shapes_match_checkpoint_on_meta(llm_config):
    keys = json.loads((FIXTURE / "tiny_keys.json").read_text())
    expected = {
        k[len("llm_model.") :]: tuple(v)
        for k, v in keys.items()
        if k.startswith("llm_model.") and not k.startswith("llm_model.model.visual.")
    }
    with torch.device("meta"):
        m = MammothARForCausalLM.from_llm_config(llm_config)
    got = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert got == expected


def test_forward_matches_reference(model, reference):
    ids = reference["ar_input_ids"]
    with torch.no_grad():
        out = model(ids, _positions(ids), output_hidden_states=True)
    torch.testing.assert_close(out.last_hidden_state[0], reference["ar_last_hidden_states"], atol=ATOL, rtol=0)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (1, 32, 812)
    torch.testing.assert_close(out.logits[0], reference["ar_logits"], atol=ATOL, rtol=0)
    all_hidden = torch.stack(out.all_hidden_states)[:, 0]
    torch.testing.assert_close(all_hidden, reference["ar_hidden_states_all"], atol=ATOL, rtol=0)


def test_condition_and_negative_hidden_states_match_reference(model, reference):
    with torch.no_grad():
        cond_ids = reference["cond_input_ids"]
        cond = model(cond_ids, _positions(cond_ids), compute_logits=False)
        neg_ids = reference["neg_input_ids"]
        neg = model(neg_ids, _positions(neg_ids), compute_logits=False)
    assert cond.logits is None
    torch.testing.assert_close(cond.last_hidden_state[0], reference["cond_last_hidden_states"], atol=ATOL, rtol=0)
    torch.testing.assert_close(neg.last_hidden_state[0], reference["neg_condition_tokens"], atol=ATOL, rtol=0)


def test_kv_cache_decoding_equals_full_forward(model, reference):
    ids = reference["ar_input_ids"]
    with torch.no_grad():
        full = model(ids, _positions(ids))
        cache = model.new_kv_cache(1, ids.shape[1])
        first = model(ids[:, :20], _positions(ids[:, :20]), kv_cache=cache)
        rows, logits = [first.last_hidden_state], [first.logits]
        for t in range(20, ids.shape[1]):
            step = model(ids[:, t : t + 1], torch.tensor([[t]]), kv_cache=cache)
            rows.append(step.last_hidden_state)
            logits.append(step.logits)
    assert cache.length == ids.shape[1]
    assert cache.nbytes == KVCache.bytes_needed(model.config, 1, ids.shape[1], torch.float32) == 2 * 4 * 2 * 32 * 16 * 4
    torch.testing.assert_close(torch.cat(rows, 1), full.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(logits, 1), full.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(full.logits[0], reference["ar_logits"], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="kv_cache full"):
        model(ids[:, :1], torch.tensor([[32]]), kv_cache=cache)


def test_padded_batch_equals_unpadded_runs(model, reference):
    """A key padding mask makes a left-padded row equal its unpadded single run (masks always applied)."""
    ids = reference["ar_input_ids"]
    short = ids[:, 12:]
    pad = torch.zeros(1, 12, dtype=torch.long)
    batch = torch.cat([ids, torch.cat([pad, short], 1)])
    key_mask = torch.ones(2, 32, dtype=torch.bool)
    key_mask[1, :12] = False
    positions = torch.stack([torch.arange(32), (torch.arange(32) - 12).clamp_min(0)])
    with torch.no_grad():
        padded = model(batch, positions, attention_mask=key_mask)
        alone = model(short, _positions(short))
    assert torch.isfinite(padded.last_hidden_state).all()
    torch.testing.assert_close(padded.logits[1, 12:], alone.logits[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded.logits[0], reference["ar_logits"], atol=ATOL, rtol=0)


def _perturbed_copy(model: MammothARForCausalLM, layer: int) -> MammothARForCausalLM:
    clone = MammothARForCausalLM(model.config)
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        clone.model.language_model.layers[layer].gen_mlp.down_proj.weight.add_(0.5)
    return clone.eval()


def test_generation_experts_route_only_generation_ids(model, reference):
    ids = reference["ar_input_ids"]
    base_only = ids[:, :20]
    assert int(base_only.max()) < model.config.gen_vocab_start_index
    perturbed = _perturbed_copy(model, layer=2)
    with torch.no_grad():
        mixed_ref, mixed_new = model(ids, _positions(ids)), perturbed(ids, _positions(ids))
        base_ref, base_new = model(base_only, _positions(base_only)), perturbed(base_only, _positions(base_only))
    # generation tokens (positions 20..31) change; the base prefix (causal, before them) does not
    assert (mixed_new.last_hidden_state[0, 20:] - mixed_ref.last_hidden_state[0, 20:]).abs().max() > 1e-2
    torch.testing.assert_close(mixed_new.last_hidden_state[0, :20], mixed_ref.last_hidden_state[0, :20], atol=0, rtol=0)
    torch.testing.assert_close(base_new.last_hidden_state, base_ref.last_hidden_state, atol=0, rtol=0)


def test_experts_act_only_in_their_layer(model, reference):
    """Layers 0-1 have no experts; perturbing layer 3's gen_mlp leaves every earlier layer's output
    unchanged and changes only generation rows after layer 3."""
    lm = model.model.language_model
    for i in (0, 1):
        assert lm.layers[i].gen_mlp is None and lm.layers[i].self_attn.gen_qkv_proj is None
    for i in (2, 3):
        assert lm.layers[i].gen_mlp is not None and lm.layers[i].self_attn.gen_o_proj is not None
    ids = reference["ar_input_ids"]
    perturbed = _perturbed_copy(model, layer=3)
    with torch.no_grad():
        ref = model(ids, _positions(ids), output_hidden_states=True)
        new = perturbed(ids, _positions(ids), output_hidden_states=True)
    for depth in range(4):  # embeddings and outputs of layers 0, 1, 2 (inputs of layers 0..3)
        torch.testing.assert_close(new.all_hidden_states[depth], ref.all_hidden_states[depth], atol=0, rtol=0)
    final_ref, final_new = ref.all_hidden_states[-1][0], new.all_hidden_states[-1][0]
    torch.testing.assert_close(final_new[:20], final_ref[:20], atol=0, rtol=0)
    assert (final_new[20:] - final_ref[20:]).abs().amax(-1).min() > 1e-3


def test_out_of_range_ids_are_rejected(model):
    with pytest.raises(ValueError, match="out of range"):
        model(torch.tensor([[812]]), torch.tensor([[0]]))
    with pytest.raises(ValueError):
        model(torch.tensor([[1, 2]]), torch.tensor([[0]]))


def test_fused_projections_speak_checkpoint_names_without_a_copy(model, llm_config, tmp_path):
    """q/k/v (and the generation experts' q/k/v, and gate/up) are one fused parameter each; the
    state dict shows them under the checkpoint's names as views of it (no second copy in memory),
    and the strict checkpoint loader fills the fused parameter through those views."""
    from safetensors.torch import save_file

    from mammoth_core.checkpoint import Checkpoint

    attn = model.language_model.layers[2].self_attn
    state = model.state_dict()
    prefix = "model.language_model.layers.2."
    assert not any(".qkv_proj." in k or ".gate_up_proj." in k for k in state)
    for name, fused in (("self_attn.q_proj.weight", attn.qkv_proj.weight),
                        ("self_attn.gen_v_proj.bias", attn.gen_qkv_proj.bias),
                        ("mlp.up_proj.weight", model.language_model.layers[2].mlp.gate_up_proj.weight)):
        view = state[prefix + name]
        assert fused.untyped_storage().data_ptr() == view.untyped_storage().data_ptr(), name
    stored = sum(v.numel() for v in state.values())
    assert stored == sum(p.numel() for p in model.parameters())  # one copy of every weight

    # through the real loader (mmap + copy into the state-dict views), on a meta-built model
    save_file({f"llm_model.{k}": v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"llm_config": llm_config}))
    with torch.device("meta"):
        fresh = MammothARForCausalLM.from_llm_config(llm_config)
    Checkpoint(tmp_path).load_module(fresh, "llm_model.", device="cpu")
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name
