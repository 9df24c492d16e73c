"""AR tensor parallelism (issue 21) on the CPU: two gloo processes, the reference fixture's model.

Each rank loads the same float32 weights, runs the unsharded model once (the reference), shards it
with `shard_ar_model_` and runs the same request again: a whole seeded text-to-image sequence
(prefill with expert routing over prompt and grid tokens, KV-cached decode steps, AR-side CFG), and
a teacher-forced forward with full logits. Sharded == unsharded: the same tokens, hidden rows and
logits within float32 summation-order error.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORLD = 2


def _load():
    from reference_fixture import REFERENCE_DIR as FIXTURE
    from safetensors.torch import load_file

    from stage_ar.modeling_mammoth_ar import MammothARForCausalLM, strip_llm_prefix

    cfg = json.loads((FIXTURE / "tiny_config_save_pretrained.json").read_text())["llm_config"]
    m = MammothARForCausalLM.from_llm_config(cfg)
    m.load_state_dict(strip_llm_prefix(load_file(FIXTURE / "tiny_reference.safetensors")), strict=True)
    return m.eval()


def _sequence(model, tok_dir: str, guidance: float):
    from stage_ar.generation import T2ISequence
    from stage_ar.sampling import GridConstrainedSampler
    from stage_ar.tokenization_mammoth import MammothTokenizer

    tok = MammothTokenizer.from_pretrained(tok_dir, base_vocab_size=512)
    w, h = 3, 2
    sampler = GridConstrainedSampler(w, h, tok.eol_id, tok.visual_token_start_id, tok.visual_token_end_id,
                                     1.0, 20, 0.9, torch.Generator().manual_seed(7))
    prompt = tok.encode_t2i_prompt("a red house by the sea", w, h)
    kwargs = {"ar_guidance_scale": guidance, "negative_prompt_ids": tok.encode_negative_prompt()} if guidance else {}
    return T2ISequence(model, prompt, w, h, sampler, **kwargs)


def _outputs(model, tok_dir: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for guidance in (0.0, 3.0):
            hidden, ids = _sequence(model, tok_dir, guidance).run()
            out[f"hidden_cfg{guidance}"] = hidden.float()
            out[f"ids_cfg{guidance}"] = torch.tensor(ids)
        ids = out["ids_cfg0.0"][None]
        positions = torch.arange(ids.shape[1])[None]
        res = model(ids, positions)
        out["logits"] = res.logits
        out["last_hidden"] = res.last_hidden_state.float()
    return out


def _worker(rank: int, init_file: str, tok_dir: str, result_dir: str) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from mammoth_core.distributed import GroupRank
        from stage_ar.tensor_parallel import RankARConfig, shard_ar_model_

        model = _load()
        reference = _outputs(model, tok_dir)
        tp = GroupRank.from_group()
        shard_ar_model_(model, tp)
        assert isinstance(model.config, RankARConfig) and model.config.num_key_value_heads == 1
        sharded = _outputs(model, tok_dir)
        torch.save({"reference": reference, "sharded": sharded}, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from stage_ar.tokenization_mammoth import write_tokenizer_files

    base = tmp_path_factory.mktemp("tp")
    tok_dir = base / "tok"
    tok_dir.mkdir()
    write_tokenizer_files(tok_dir, num_visual_tokens=256)
    mp.start_processes(_worker, args=(str(base / "init"), str(tok_dir), str(base)), nprocs=WORLD,
                       join=True, start_method="spawn")
    return [torch.load(base / f"rank{r}.pt") for r in range(WORLD)]


def test_sharded_forward_equals_unsharded(results):
    for rank, res in enumerate(results):
        ref, got = res["reference"], res["sharded"]
        for key in ref:
            if key.startswith("ids"):
                assert torch.equal(got[key], ref[key]), f"rank {rank}: {key} differs"
            else:
                torch.testing.assert_close(got[key], ref[key], atol=2e-5, rtol=1e-5, msg=f"rank {rank}: {key}")


def test_every_rank_holds_the_same_outputs(results):
    """Replicated heads and all-reduced layers: rank 1 sees exactly what rank 0 streams."""
    for key, value in results[0]["sharded"].items():
        assert torch.equal(results[1]["sharded"][key], value), key


def test_sharding_refuses_what_it_cannot_split():
    from mammoth_core.distributed import GroupRank
    from stage_ar.tensor_parallel import shard_ar_model_

    model = _load()  # 4 query heads, 2 key/value heads
    with pytest.raises(ValueError, match="num_key_value_heads 2"):
        shard_ar_model_(model, GroupRank(rank=0, world_size=4))
    assert shard_ar_model_(model, GroupRank(rank=0, world_size=1)) is model


def test_the_stage_loader_shards_first_then_converts_the_shard_to_fp8(tiny_checkpoint, tmp_path):
    """``weights_dtype: fp8`` with tensor parallelism: each rank's FP8 codes and row scales are those of
    its own shard (column-parallel rows keep their scales, row-parallel scales come from the rank's
    columns), so the conversion never sees (or holds) the full matrices."""
    from mammoth_core.distributed import GroupRank
    from stage_ar.fp8 import quantize_fp8_per_channel
    from stage_ar.loader import load_ar

    full = load_ar(str(tiny_checkpoint), str(tmp_path), "cpu", torch.float32).model
    for rank in range(2):
        shard = load_ar(str(tiny_checkpoint), str(tmp_path), "cpu", torch.float32, weights_dtype="fp8",
                        tensor_parallel=GroupRank(rank=rank, world_size=2)).model
        pairs = list(zip(full.visual_token_linears(), shard.visual_token_linears()))
        assert pairs and all(s.is_fp8 for _, s in pairs)
        for f, s in pairs:
            if s.in_features != f.in_features:  # row parallel: this rank's columns
                expected = f.weight.data.chunk(2, dim=1)[rank]
            else:  # column parallel: this rank's rows of each stacked part
                assert s.out_features < f.out_features
                expected = None
            if expected is not None:
                codes, scale = quantize_fp8_per_channel(expected.contiguous())
                assert torch.equal(s.weight_scale, scale) and torch.equal(s.weight.view(torch.uint8),
                                                                          codes.view(torch.uint8))
            assert s.weight_scale.shape == (s.out_features,)
