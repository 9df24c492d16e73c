"""Speculative Jacobi decoding in the AR engine (`stage_ar.jacobi`) on the reference fixture's model.

CPU, float32. What must hold:

* the grid a ``jacobi`` request samples has the distribution a ``sequential`` one has: on 3x1 and
  1x3 grids with top-k 3 (27 possible grids), 500 seeds per configuration against the exact law
  of the grid computed by teacher forcing, Pearson's chi-square at level 1e-4; the power of the
  test against a total-variation deviation of 0.05 is computed and asserted (>= 0.95; it is 0.99
  and 0.97 for the two grids, and 1.0 against a deviation of 0.07);
* the streamed rows are the rows of a teacher-forced forward over the final tokens;
* a seed gives the same grid and rows every time, alone or batched with sequential requests (batch
  invariance, bit for bit), in the exact-rows and the batched-forward modes;
* cancelling a request between two windows frees its slots, admission and window.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from chi_square import p_value, power, tilt

from mammoth_core.decoding import ARDecoding, DecodingOptions
from stage_ar.engine import CollectingSink, DecodeEngine, DecodeJob, Role
from stage_ar.generation import T2ISequence
from stage_ar.sampling import GridConstrainedSampler

ALPHA = 1e-4
PROMPT = "a red house"
JACOBI = DecodingOptions(ARDecoding.JACOBI, window=4)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded 2-core CI machine: intra-op threads only contend
    yield
    torch.set_num_threads(threads)


def grid_ids(tok):
    return tok.eol_id, tok.visual_token_start_id, tok.visual_token_end_id


def make_engine(model, tok, top_k=None, running=8, length=96, progress_interval_s=0.05, **options):
    def make_sequence(job):
        sampler = GridConstrainedSampler(job.ar_width, job.ar_height, *grid_ids(tok), 1.0, top_k, 1.0,
                                         torch.Generator().manual_seed(job.seed))
        return T2ISequence(model, job.prompt_ids, job.ar_width, job.ar_height, sampler,
                           ar_guidance_scale=job.ar_guidance_scale, decoding=job.decoding)
    return DecodeEngine(make_sequence, running, model=model, grid_ids=grid_ids(tok), max_sequence_length=length,
                        progress_interval_s=progress_interval_s, decoder_options=options)


def make_job(tok, seed, w, h, decoding=JACOBI, scale=0.0, prompt=PROMPT, **kw):
    return DecodeJob(f"r{seed}", 0, tok.encode_t2i_prompt(prompt, w, h), None, w, h, seed, 0, 0, 0, scale,
                     CollectingSink(), lambda done, total: None, lambda exc, stats: None, decoding=decoding, **kw)


def run_all(engine, jobs, chunk):
    for i in range(0, len(jobs), chunk):
        for job in jobs[i : i + chunk]:
            engine.submit(job)
        engine.run_until_idle()
    return jobs


@torch.inference_mode()
def exact_law(model, tok, w, h, k=3):
    """The law of the grid's visual codes under top-k-``k`` sampling (temperature 1), by teacher
    forcing every prefix: ``{codes: probability}``."""
    eol, vstart, vend = grid_ids(tok)
    prompt = tok.encode_t2i_prompt(PROMPT, w, h)
    law = {(): 1.0}
    for index in range(h * (w + 1)):
        if index % (w + 1) == w:
            continue
        grown = {}
        for codes, prob in law.items():
            ids, it = list(prompt), iter(codes)
            for j in range(index):
                ids.append(eol if j % (w + 1) == w else next(it))
            t = torch.tensor([ids])
            logits = model(t, torch.arange(t.shape[1])[None]).logits[0, -1, vstart:vend].double()
            top = torch.topk(logits, k)
            for value, p in zip((top.indices + vstart).tolist(), torch.softmax(top.values, 0).tolist()):
                grown[codes + (value,)] = prob * p
        law = grown
    return law


@pytest.mark.parametrize("w,h,options", [
    (3, 1, JACOBI),
    (1, 3, DecodingOptions(ARDecoding.JACOBI, window=6, token_reuse=True, spatial_init=True)),
])
def test_jacobi_samples_the_sequential_distribution(model, tokenizer, w, h, options):
    law = exact_law(model, tokenizer, w, h)
    cells = sorted(law)
    probs = torch.tensor([law[c] for c in cells], dtype=torch.float64)
    n = 500
    engine = make_engine(model, tokenizer, top_k=3, running=64, exact_rows=False)
    jobs = run_all(engine, [make_job(tokenizer, seed, w, h, options) for seed in range(n)], 64)
    eol = tokenizer.eol_id
    counts = torch.zeros(len(cells), dtype=torch.float64)
    index = {c: i for i, c in enumerate(cells)}
    for job in jobs:
        codes = tuple(t for t in job.sink.token_ids[Role.CONDITION][len(job.prompt_ids):] if t != eol)
        counts[index[codes]] += 1
    assert p_value(counts, probs) > ALPHA, (counts.tolist(), (probs * n).tolist())
    r = engine.runner.jacobi
    assert r.tokens / r.forwards > 1.0  # windows really took several tokens per forward
    assert power(probs, tilt(probs, 0.05), n, ALPHA, trials=2000) >= 0.95


def triton_runs_here() -> bool:
    from stage_ar import decode_attention

    return decode_attention.available(torch.device("cpu"))


@pytest.mark.parametrize("options", [
    {},
    {"exact_rows": False},
    # the split-KV Triton kernels (sequential step and window forward) in Triton's interpreter
    pytest.param({"exact_rows": False, "fused_attention": True}, marks=[pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.skipif(
        not triton_runs_here(), reason="needs a CPU-only machine (Triton's interpreter; the fixture model runs on the CPU)")]),
], ids=["exact_rows", "batched_gemm", "batched_triton"])
def test_rows_equal_teacher_forcing_and_a_seed_is_reproducible_in_any_batch(model, tokenizer, options):
    alone = run_all(make_engine(model, tokenizer, **options), [make_job(tokenizer, 11, 3, 3)], 1)[0]
    others = [make_job(tokenizer, s, 2, 2, decoding=DecodingOptions(), prompt="two cats") for s in (1, 2)]
    cfg = make_job(tokenizer, 12, 2, 3, scale=3.0, prompt="blue")
    again = make_job(tokenizer, 11, 3, 3)
    run_all(make_engine(model, tokenizer, **options), [others[0], cfg, again, others[1]], 4)
    for a, b in ((alone, again),):
        assert a.sink.token_ids[Role.CONDITION] == b.sink.token_ids[Role.CONDITION]
        assert torch.equal(a.sink.hidden(), b.sink.hidden()), options
    ids = alone.sink.token_ids[Role.CONDITION]
    assert len(ids) == len(alone.prompt_ids) + 3 * 4
    teacher = model(torch.tensor([ids]), torch.arange(len(ids))[None], compute_logits=False).last_hidden_state[0]
    torch.testing.assert_close(alone.sink.hidden(), teacher, atol=2e-5, rtol=0)
    # the sequential requests in that batch got the rows they get alone
    for job in others:
        ref = run_all(make_engine(model, tokenizer, **options), [make_job(
            tokenizer, job.seed, 2, 2, decoding=DecodingOptions(), prompt="two cats")], 1)[0]
        assert job.sink.token_ids[Role.CONDITION] == ref.sink.token_ids[Role.CONDITION]
        assert torch.equal(job.sink.hidden(), ref.sink.hidden())
    # AR-side CFG with Jacobi windows: rows are teacher forcing of the conditional row too
    ids = cfg.sink.token_ids[Role.CONDITION]
    teacher = model(torch.tensor([ids]), torch.arange(len(ids))[None], compute_logits=False).last_hidden_state[0]
    torch.testing.assert_close(cfg.sink.hidden(), teacher, atol=2e-5, rtol=0)


def test_cancel_between_windows_frees_everything(model, tokenizer):
    # Every row reports progress, and the engine thread holds at the first decoded one until the
    # test has cancelled: the cancel lands between windows however fast the host decodes (with the
    # default 50 ms interval a fast host could finish all 72 tokens before the first report, and CI
    # saw the job succeed instead of being cancelled).
    engine = make_engine(model, tokenizer, running=2, length=160, progress_interval_s=0.0)
    started, cancelled = threading.Event(), threading.Event()
    done, first_report = [], []
    job = make_job(tokenizer, 3, 8, 8, decoding=DecodingOptions(ARDecoding.JACOBI, window=2))

    def on_progress(decoded: int, total: int) -> None:
        if decoded > 0 and not started.is_set():
            first_report.append((decoded, total))
            started.set()
            cancelled.wait(30)

    job.on_progress = on_progress
    job.on_done = lambda exc, stats: done.append(exc)
    engine.start()
    try:
        engine.submit(job)
        assert started.wait(30)
        job.cancel()
        cancelled.set()
        assert first_report[0][0] < first_report[0][1], first_report  # cancelled before its end
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done and done[0] is not None
        assert engine.running == 0
        while engine.runner.active_count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.runner.active_count == 0 and len(engine.runner.jacobi) == 0
        assert engine.scheduler.slots.free_slots == engine.runner.num_slots
        assert job.sink.aborted and not job.sink.finished
        # the engine serves the next request (the freed slot is reused)
        nxt = make_job(tokenizer, 4, 2, 2)
        finished = threading.Event()
        nxt.on_done = lambda exc, stats: finished.set()
        engine.submit(nxt)
        assert finished.wait(30) and nxt.sink.finished
    finally:
        engine.stop()


def test_marking_a_windows_tokens_seen_equals_marking_them_one_by_one():
    """`GridSampler.mark_seen` with ``(b, n)`` tokens (a window's final ids, non-codes and repeats
    among them) sets exactly what ``n`` one-token calls set, only for active rows."""
    from stage_ar.sampling import GridSampler, SamplingState

    sampler = GridSampler(eol_token_id=100, visual_token_start_id=108, visual_token_end_id=116)
    fed = torch.tensor([[108, 100, 115, 108, 109], [100, 116, 107, 110, 110]])
    active = torch.tensor([True, False])
    window, one_by_one = (SamplingState.allocate(2, 8, 4, "cpu") for _ in range(2))
    one_by_one.seen[1, 3] = window.seen[1, 3] = True  # already seen: stays
    sampler.mark_seen(window, fed, active)
    for j in range(fed.shape[1]):
        sampler.mark_seen(one_by_one, fed[:, j], active)
    assert torch.equal(window.seen, one_by_one.seen)
    assert window.seen[0].nonzero().flatten().tolist() == [0, 1, 7] and window.seen[1].sum() == 1
