"""CUDA checks of the Jacobi window path (issue 18) at MammothModa2-Preview dimensions, random bf16 weights.

Run on the GPU machine from the source tree (about a minute on one H200; ``--tiny`` on CPU):

    PYTHONPATH=. python benchmarks/jacobi_check.py --out "$OUT"

Checks (``jacobi_check.json``; exit status 1 if any fails):
1. ``window_one_bits``: `window_attention` with ``T = 1`` equals `decode_attention` bit for bit (bf16);
2. ``graph_equals_eager``: a Jacobi decode with the window forward replayed as CUDA graphs gives the
   tokens and bit-identical rows of the same decode run eagerly;
3. ``teacher_forcing``: the streamed rows against one full forward over the final tokens (max abs
   error), next to the same error of a sequential decode (bf16 rounding, not a bug, sets both);
4. ``batch_invariance``: in the batch-invariant engine a Jacobi request alone and next to two
   sequential ones gives the same tokens and bits, and the sequential ones their rows alone;
5. ``seed``: the same seed gives the same grid.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.jacobi import EOL, PROMPT, VEND, VSTART, build, sharpen  # noqa: E402
from mammoth_core.decoding import ARDecoding, DecodingOptions  # noqa: E402
from stage_ar import decode_attention  # noqa: E402
from stage_ar.engine import CollectingSink, DecodeEngine, DecodeJob, Role  # noqa: E402
from stage_ar.generation import T2ISequence  # noqa: E402
from stage_ar.sampling import GridConstrainedSampler  # noqa: E402

JACOBI = DecodingOptions(ARDecoding.JACOBI, 16, True, True)


def window_one_bits(device: torch.device) -> bool | None:
    if not decode_attention.available(device) or device.type != "cuda":
        return None
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(3, 1, 28, 128, device=device, generator=g).bfloat16()
    kv = torch.randn(3, 1, 2, 4, 128, device=device, generator=g).bfloat16()
    cache = torch.randn(2, 3, 4, 1024, 128, device=device, generator=g).bfloat16()
    pos, start = torch.tensor([5, 700, 130], device=device), torch.tensor([0, 3, 64], device=device)
    c1 = cache.clone()
    want = decode_attention.decode_attention(q[:, 0], kv[:, 0, 0], kv[:, 0, 1], c1[0], c1[1], pos, start, 1024, 0.088)
    got = decode_attention.window_attention(q, kv[:, :, 0], kv[:, :, 1], cache[0], cache[1],
                                            torch.arange(3, device=device), pos, start, 1024, 0.088)
    return bool(torch.equal(got[:, 0], want) and torch.equal(cache, c1))


def engine(model, grid: int, slots: int, batch_invariant: bool = True, **options) -> DecodeEngine:
    def make(job: DecodeJob) -> T2ISequence:
        sampler = GridConstrainedSampler(job.ar_width, job.ar_height, EOL, VSTART, VEND, 1.0, None, 1.0,
                                         torch.Generator().manual_seed(job.seed))
        return T2ISequence(model, job.prompt_ids, job.ar_width, job.ar_height, sampler, decoding=job.decoding)
    capacity = len(PROMPT) + grid * (grid + 1) + 16
    return DecodeEngine(make, slots, model=model, grid_ids=(EOL, VSTART, VEND), max_sequence_length=capacity,
                        kv_slots=slots, batch_invariant=batch_invariant, decoder_options=options)


def decode(eng: DecodeEngine, grid: int, seeds_and_modes: list[tuple[int, DecodingOptions]]) -> list[DecodeJob]:
    jobs = [DecodeJob(f"r{i}", 0, list(PROMPT), None, grid, grid, seed, 0, 0, 0, 0.0, CollectingSink(),
                      lambda a, b: None, lambda exc, s: None, decoding=mode)
            for i, (seed, mode) in enumerate(seeds_and_modes)]
    for job in jobs:
        eng.submit(job)
    eng.run_until_idle()
    return jobs


def ids_rows(job: DecodeJob) -> tuple[list[int], torch.Tensor]:
    return job.sink.token_ids[Role.CONDITION], job.sink.hidden()


@torch.inference_mode()
def teacher_error(model, job: DecodeJob, device) -> float:
    ids, rows = ids_rows(job)
    t = torch.tensor([ids], device=device)
    full = model(t, torch.arange(t.shape[1], device=device)[None], compute_logits=False).last_hidden_state[0]
    return float((rows.to(device).float() - full.float()).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/jacobi_check")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--grid", type=int, default=0)
    args = parser.parse_args()
    model, device = build(args.tiny)
    sharpen(model, model.gen_head.weight.clone(), model.language_model.gen_embed_tokens.weight.clone(), 16.0, 0.01)
    grid = args.grid or (3 if args.tiny else 12)
    res: dict = {"window_one_bits": window_one_bits(device)}
    graphs = decode(engine(model, grid, 1, batch_invariant=False), grid, [(5, JACOBI)])[0]
    eager = decode(engine(model, grid, 1, batch_invariant=False, cuda_graphs=False), grid, [(5, JACOBI)])[0]
    res["graph_equals_eager"] = ids_rows(graphs)[0] == ids_rows(eager)[0] and torch.equal(
        ids_rows(graphs)[1], ids_rows(eager)[1])
    seq = decode(engine(model, grid, 1, batch_invariant=False), grid, [(5, DecodingOptions())])[0]
    res["teacher_forcing"] = {"jacobi_max_abs": teacher_error(model, graphs, device),
                              "sequential_max_abs": teacher_error(model, seq, device)}
    inv = engine(model, grid, 4)
    alone = decode(inv, grid, [(7, JACOBI)])[0]
    mixed = decode(inv, grid, [(1, DecodingOptions()), (7, JACOBI), (2, DecodingOptions())])
    seq_alone = [decode(inv, grid, [(s, DecodingOptions())])[0] for s in (1, 2)]
    same = ids_rows(alone)[0] == ids_rows(mixed[1])[0] and torch.equal(ids_rows(alone)[1], ids_rows(mixed[1])[1])
    neighbours = all(ids_rows(a)[0] == ids_rows(b)[0] and torch.equal(ids_rows(a)[1], ids_rows(b)[1])
                     for a, b in zip(seq_alone, (mixed[0], mixed[2])))
    res["batch_invariance"] = {"jacobi": same, "sequential_neighbours": neighbours}
    res["seed"] = ids_rows(decode(inv, grid, [(7, JACOBI)])[0])[0] == ids_rows(alone)[0]
    res["window_graphs_captured"] = inv.runner.jacobi.window_forward.graphs_captured
    tf = res["teacher_forcing"]
    res["teacher_forcing"]["ok"] = tf["jacobi_max_abs"] <= 2 * tf["sequential_max_abs"] + 1e-4
    ok = (res["window_one_bits"] in (True, None) and res["graph_equals_eager"] and tf["ok"]
          and same and neighbours and res["seed"])
    res["ok"] = bool(ok)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "jacobi_check.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
