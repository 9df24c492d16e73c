"""Batched AR decode (`ARModelRunner`, `DecodeEngine`) against the B=1 `T2ISequence` reference.

CPU, float32, the reference fixture's tiny model. Staggered requests with different grid sizes and
sampling settings (top-k, top-p, greedy, repetition penalty, AR-side CFG) share one batch; every
request must produce exactly the tokens and hidden rows it produces alone.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from stage_ar.engine import DecodeEngine, DecodeJob, EngineCancelled, Role
from stage_ar.generation import T2ISequence
from stage_ar.kv_pool import KVPool
from stage_ar.layers import PointwiseOps
from stage_ar.runner import ARModelRunner
from stage_ar.scheduler import SlotAllocator
from stage_ar.sampling import GridConstrainedSampler
from stage_ar.tokenization_mammoth import MammothTokenizer

# (width, height, seed, sampler overrides, ar_guidance_scale, join at step)
SPECS = [
    (3, 2, 1, {}, 0.0, 0),
    (2, 3, 2, {"top_k": 5}, 0.0, 1),
    (4, 1, 3, {"top_p": 0.7}, 3.0, 2),
    (2, 2, 5, {"repetition_penalty": 1.3, "temperature": 0.7}, 0.0, 3),
    (1, 2, 4, {"temperature": 0.0}, 0.0, 5),
    (3, 1, 6, {"top_k": 20, "top_p": 0.9}, 2.0, 9),
]
PROMPTS = ["a red house", "two cats on a mat", "the sea at night", "a tree", "blue", "a small boat"]
CAPACITY = 96


def grid_ids(tok: MammothTokenizer) -> tuple[int, int, int]:
    return tok.eol_id, tok.visual_token_start_id, tok.visual_token_end_id


def make_seq(model, tok, i: int) -> T2ISequence:
    w, h, seed, overrides, scale, _ = SPECS[i]
    params = {"temperature": 1.0, "top_k": None, "top_p": 1.0, "repetition_penalty": 1.0} | overrides
    sampler = GridConstrainedSampler(
        w, h, *grid_ids(tok), params["temperature"], params["top_k"], params["top_p"],
        torch.Generator().manual_seed(seed), repetition_penalty=params["repetition_penalty"],
    )
    return T2ISequence(model, tok.encode_t2i_prompt(PROMPTS[i], w, h), w, h, sampler, ar_guidance_scale=scale)


@pytest.fixture(scope="module")
def references(model, tokenizer):
    out = []
    for i in range(len(SPECS)):
        seq = make_seq(model, tokenizer, i)
        hidden, ids = seq.run()
        out.append((hidden, ids, seq.lookahead_id, seq.sampler.generator.get_state()))
    return out


def run_staggered(model, tok, **options):
    """Drive an `ARModelRunner` directly: request i joins before step SPECS[i][5]."""
    decoder = ARModelRunner(model, 8, CAPACITY, **dict(zip(("eol_token_id", "visual_token_start_id",
                             "visual_token_end_id"), grid_ids(tok))), **options)
    slots = SlotAllocator(decoder.num_slots)
    rows: dict[int, list[torch.Tensor]] = {}
    seqs: dict[int, T2ISequence] = {}
    firsts: dict[int, int] = {}
    batch_sizes = []
    step = 0
    while step == 0 or decoder.active_count or len(seqs) < len(SPECS):
        for i, spec in enumerate(SPECS):
            if spec[5] == step:
                seqs[i] = seq = make_seq(model, tok, i)
                firsts[i] = first = slots.alloc(seq.cache_batch)
                seq.attach_kv_cache(decoder.kv_view(first, seq.cache_batch))
                rows[i] = [seq.prefill().hidden]
                decoder.activate(i, seq, first)
        batch_sizes.append(decoder.active_count)
        pending = decoder.launch()
        step += 1
        if pending is None:
            continue
        fed, sampled = decoder.collect(pending)
        for e in pending.entries:
            seqs[e.key].record_external_step(fed[e.slot], sampled[e.slot])
            rows[e.key].append(pending.hidden[e.slot : e.slot + 1])
            if e.finished:
                slots.free(firsts[e.key], seqs[e.key].cache_batch)
    assert slots.free_slots == decoder.num_slots and decoder.active_count == 0  # every slot came back
    assert max(batch_sizes) >= 4  # the requests really shared steps
    return {i: (torch.cat(rows[i]), seqs[i]) for i in seqs}


def test_exact_rows_mode_is_bit_identical_to_the_reference(model, tokenizer, references):
    got = run_staggered(model, tokenizer)  # CPU default: exact_rows
    for i, (hidden, seq) in got.items():
        ref_hidden, ref_ids, ref_lookahead, ref_state = references[i]
        assert seq.prompt_ids + seq.generated_ids == ref_ids, f"request {i}"
        assert seq.lookahead_id == ref_lookahead
        assert torch.equal(hidden, ref_hidden), f"request {i}: rows differ"
        # the generator was consumed exactly as the B=1 path consumes it
        assert torch.equal(seq.sampler.generator.get_state(), ref_state)


def test_batched_rows_mode_matches_the_reference(model, tokenizer, references):
    """The vectorised GPU code path (batched GEMMs, pool-wide masked attention, sliced head)."""
    got = run_staggered(model, tokenizer, exact_rows=False)
    for i, (hidden, seq) in got.items():
        ref_hidden, ref_ids, ref_lookahead, _ = references[i]
        assert seq.prompt_ids + seq.generated_ids == ref_ids, f"request {i}"
        assert seq.lookahead_id == ref_lookahead
        torch.testing.assert_close(hidden, ref_hidden, atol=2e-5, rtol=0)


def test_pad_to_max_bucket_matches_too(model, tokenizer, references):
    got = run_staggered(model, tokenizer, exact_rows=False, pad_to_max_bucket=True)
    for i, (hidden, seq) in got.items():
        assert seq.prompt_ids + seq.generated_ids == references[i][1]
        torch.testing.assert_close(hidden, references[i][0], atol=2e-5, rtol=0)


def test_length_buckets_and_sortless_sampler_match_too(model, tokenizer, references):
    """Attention over the batch's length rounded up to 16 positions (several graph shapes) and the
    sampler without sorts whenever no running request uses top-k/top-p: same tokens as B=1."""
    got = run_staggered(model, tokenizer, exact_rows=False, length_bucket=16)
    for i, (hidden, seq) in got.items():
        assert seq.prompt_ids + seq.generated_ids == references[i][1], f"request {i}"
        torch.testing.assert_close(hidden, references[i][0], atol=2e-5, rtol=0)
    dec = ARModelRunner(model, 2, CAPACITY, **dict(zip(("eol_token_id", "visual_token_start_id",
                         "visual_token_end_id"), grid_ids(tokenizer))), exact_rows=False, length_bucket=16)
    assert dec.length_buckets == (16, 32, 48, 64, 80, 96) and not dec.compile  # CPU default: no compile
    seq = make_seq(model, tokenizer, 0)
    seq.attach_kv_cache(dec.kv_view(0, 1))
    seq.prefill()
    dec.activate(0, seq, 0)
    b, length, sort, rows = dec.next_shape()
    assert b == 1 and rows == 1 and length >= seq.prompt_len + 1 and length - 16 < seq.prompt_len + 1
    assert sort == (seq.sampler.top_k is not None or seq.sampler.top_p < 1.0)


def test_compile_failure_falls_back_to_eager(model, tokenizer, references, monkeypatch, caplog):
    """A compiled helper that fails (as an Inductor/Triton error would) leaves a working decoder."""
    import stage_ar.runner as runner_module

    def broken(*args, **kwargs):
        raise RuntimeError("simulated compilation failure")

    broken_ops = PointwiseOps(**dict.fromkeys(("rms_norm", "add_rms_norm", "rope_qkv", "silu_and_mul",
                                               "masked_softmax"), broken), compiled=True)
    monkeypatch.setattr(runner_module, "compiled_ops", lambda: broken_ops)
    with caplog.at_level("WARNING", logger="stage_ar.runner"):
        got = run_staggered(model, tokenizer, exact_rows=False, compile=True)
    assert "using eager kernels" in caplog.text
    for i, (hidden, seq) in got.items():
        assert seq.prompt_ids + seq.generated_ids == references[i][1], f"request {i}"
        torch.testing.assert_close(hidden, references[i][0], atol=2e-5, rtol=0)


def test_pool_views(model):
    pool = KVPool(model.config, 4, 10, dtype=torch.float32)
    assert pool.capacity == 16
    view = pool.view(1, 2)
    assert view.batch_size == 2 and view.capacity == 16 and view.length == 0
    k = torch.randn(2, model.config.num_key_value_heads, 3, model.config.head_dim)
    view.write(0, k, k)
    assert torch.equal(pool.key[0, 1:3, :, :3], k)


class RecordingSink:
    """A `RowSink` keeping every row; can cancel its job after ``cancel_after`` CONDITION rows."""

    def __init__(self, cancel_after: int | None = None):
        self.rows: list[torch.Tensor] = []
        self.ids: list[int] = []
        self.finished = self.aborted = False
        self.cancel_after = cancel_after
        self.job: DecodeJob | None = None

    def put_rows(self, role, hidden, token_ids):
        assert role is Role.CONDITION
        self.rows.append(hidden.clone())
        self.ids.extend(int(t) for t in token_ids)
        if self.cancel_after is not None and len(self.ids) >= self.cancel_after and self.job is not None:
            self.job.cancel()

    def finish(self):
        self.finished = True

    def abort(self):
        self.aborted = True


def test_engine_thread_staggered_jobs_and_cancellation(model, tokenizer, references):
    def factory(job: DecodeJob) -> T2ISequence:
        return make_seq(model, tokenizer, job.seed)  # the spec index travels as the seed

    engine = DecodeEngine(factory, 5, model=model, grid_ids=grid_ids(tokenizer), max_sequence_length=CAPACITY)
    engine.start()
    assert engine.ready.wait(30)
    done: dict[str, tuple[BaseException | None, object]] = {}
    finished = threading.Event()

    def submit(i: int, sink: RecordingSink) -> DecodeJob:
        w, h = SPECS[i][:2]
        job = DecodeJob(
            request_id=f"r{i}-{id(sink)}", epoch=0, prompt_ids=make_seq(model, tokenizer, i).prompt_ids,
            negative_ids=None, ar_width=w, ar_height=h, seed=i, temperature=0, top_k=0, top_p=0,
            ar_guidance_scale=SPECS[i][4], sink=sink, on_progress=lambda a, b: None,
            on_done=lambda exc, stats, rid=f"r{i}-{id(sink)}": (done.__setitem__(rid, (exc, stats)),
                                                                 finished.set()),
        )
        sink.job = job
        engine.submit(job)
        return job

    try:
        sinks = {i: RecordingSink() for i in range(4)}
        cancelled_sink = RecordingSink(cancel_after=len(make_seq(model, tokenizer, 1).prompt_ids) + 2)
        jobs = {0: submit(0, sinks[0])}
        deadline = time.monotonic() + 30
        while len(sinks[0].ids) < 25 and time.monotonic() < deadline:
            time.sleep(0.001)
        jobs[1] = submit(1, sinks[1])
        jobs[9] = submit(1, cancelled_sink)
        jobs[2] = submit(2, sinks[2])
        jobs[3] = submit(3, sinks[3])
        while len(done) < 5 and time.monotonic() < deadline:
            if finished.wait(0.05):
                finished.clear()  # else the set event makes this loop spin, starving the engine thread
        assert len(done) == 5, done
        while not all(sinks[i].finished for i in range(4)) and time.monotonic() < deadline:
            time.sleep(0.01)  # on_done comes first, then the sink is finished
        for i in range(4):
            exc, stats = done[jobs[i].request_id]
            assert exc is None and sinks[i].finished and not sinks[i].aborted
            ref_hidden, ref_ids, _, _ = references[i]
            assert sinks[i].ids == ref_ids  # rows reached the sink in order
            assert torch.equal(torch.cat(sinks[i].rows), ref_hidden)
            assert stats.rows_sent == len(ref_ids)
        exc, _ = done[jobs[9].request_id]
        assert isinstance(exc, EngineCancelled) and cancelled_sink.aborted and not cancelled_sink.finished
        assert len(cancelled_sink.ids) < len(references[1][1])
        assert engine.running == 0
        deadline_slots = time.monotonic() + 5
        while engine.scheduler.slots.free_slots != engine.runner.num_slots and time.monotonic() < deadline_slots:
            time.sleep(0.01)
        assert engine.scheduler.slots.free_slots == engine.runner.num_slots  # the cancelled slot came back
        assert engine.runner.active_count == 0
        # the freed slots serve a new request correctly
        again = RecordingSink()
        job = submit(5, again)
        while job.request_id not in done and time.monotonic() < deadline + 30:
            if finished.wait(0.05):
                finished.clear()  # else the set event makes this loop spin, starving the engine thread
        assert done[job.request_id][0] is None
        assert again.ids == references[5][1] and torch.equal(torch.cat(again.rows), references[5][0])
    finally:
        engine.stop()


def test_too_long_request_fails_cleanly(model, tokenizer):
    engine = DecodeEngine(lambda job: make_seq(model, tokenizer, 0), 1, model=model, grid_ids=grid_ids(tokenizer),
                          max_sequence_length=16)
    seq = make_seq(model, tokenizer, 0)
    job = DecodeJob(request_id="long", epoch=0, prompt_ids=seq.prompt_ids, negative_ids=None, ar_width=3,
                    ar_height=2, seed=0, temperature=0, top_k=0, top_p=0, ar_guidance_scale=0, sink=RecordingSink(),
                    on_progress=lambda a, b: None, on_done=lambda exc, stats: None)
    with pytest.raises(ValueError, match="positions"):
        engine.submit(job)
    assert engine.running == 0 and engine.scheduler.slots.free_slots == 2


class BlockingSink(RecordingSink):
    """A sink whose ``put_rows`` holds the engine thread after ``block_after`` rows until released."""

    def __init__(self, block_after: int):
        super().__init__()
        self.block_after = block_after
        self.blocked = threading.Event()
        self.release = threading.Event()

    def put_rows(self, role, hidden, token_ids):
        super().put_rows(role, hidden, token_ids)
        if len(self.ids) >= self.block_after and not self.release.is_set():
            self.blocked.set()
            self.release.wait(30)


def test_cancelled_job_frees_its_admission_at_once(model, tokenizer, references):
    """Issue 15 item 7: a strictly sequential client cancels its request and sends the next one at
    once; the AR must admit it (max_running_sequences=1) even while the engine thread is busy."""

    def factory(job: DecodeJob) -> T2ISequence:
        return make_seq(model, tokenizer, job.seed)

    engine = DecodeEngine(factory, 1, model=model, grid_ids=grid_ids(tokenizer), max_sequence_length=CAPACITY)
    engine.start()
    assert engine.ready.wait(30)
    done: dict[str, BaseException | None] = {}
    finished = threading.Event()

    def job_for(i: int, sink) -> DecodeJob:
        w, h = SPECS[i][:2]
        job = DecodeJob(
            request_id=f"seq{i}", epoch=0, prompt_ids=make_seq(model, tokenizer, i).prompt_ids, negative_ids=None,
            ar_width=w, ar_height=h, seed=i, temperature=0, top_k=0, top_p=0, ar_guidance_scale=SPECS[i][4],
            sink=sink, on_progress=lambda a, b: None,
            on_done=lambda exc, stats, rid=f"seq{i}": (done.__setitem__(rid, exc), finished.set()),
        )
        sink.job = job
        return job

    try:
        first_sink = BlockingSink(block_after=len(make_seq(model, tokenizer, 0).prompt_ids) + 2)
        first = job_for(0, first_sink)
        engine.submit(first)
        assert first_sink.blocked.wait(30)  # the engine thread is inside a step now
        first.cancel()
        second_sink = RecordingSink()
        engine.submit(job_for(3, second_sink))  # today: EngineFull until the engine thread reaps
        first_sink.release.set()
        deadline = time.monotonic() + 30
        while not ("seq3" in done and second_sink.finished) and time.monotonic() < deadline:
            if finished.wait(0.05):  # on_done comes first, then the sink is finished
                finished.clear()  # else the set event makes this loop spin, starving the engine thread
        assert isinstance(done["seq0"], EngineCancelled) and first_sink.aborted
        assert done["seq3"] is None and second_sink.finished
        assert second_sink.ids == references[3][1] and torch.equal(torch.cat(second_sink.rows), references[3][0])
    finally:
        first_sink.release.set()
        engine.stop()


def test_deadline_aborts_the_job_and_inline_run_raises(model, tokenizer):
    """A job whose deadline has passed is aborted at the next schedule (its sink aborted, on_done
    told why); `run_job` (the in-process path) raises that error."""
    from stage_ar.engine import CollectingSink, EngineDeadlineExceeded

    engine = DecodeEngine(lambda job: make_seq(model, tokenizer, 0), 1, model=model, grid_ids=grid_ids(tokenizer),
                          max_sequence_length=CAPACITY)
    sink, outcomes = CollectingSink(), []
    job = DecodeJob(request_id="late", epoch=0, prompt_ids=make_seq(model, tokenizer, 0).prompt_ids, negative_ids=None,
                    ar_width=3, ar_height=2, seed=0, temperature=0, top_k=0, top_p=0, ar_guidance_scale=0, sink=sink,
                    on_progress=lambda a, b: None, on_done=lambda exc, stats: outcomes.append(exc),
                    deadline=time.monotonic() - 1.0)
    with pytest.raises(EngineDeadlineExceeded):
        engine.run_job(job)
    assert isinstance(outcomes[0], EngineDeadlineExceeded) and sink.aborted and not sink.finished
    assert engine.running == 0 and engine.scheduler.slots.free_slots == engine.runner.num_slots
    ok = CollectingSink()  # the same engine serves the next job
    engine.run_job(DecodeJob(request_id="ok", epoch=0, prompt_ids=job.prompt_ids, negative_ids=None, ar_width=3,
                             ar_height=2, seed=0, temperature=0, top_k=0, top_p=0, ar_guidance_scale=0, sink=ok,
                             on_progress=lambda a, b: None, on_done=lambda exc, stats: None))
    hidden, ids = make_seq(model, tokenizer, 0).run()
    assert ok.finished and ok.token_ids[Role.CONDITION] == ids and torch.equal(ok.hidden(), hidden)


def test_capture_refuses_while_a_request_is_active(model, tokenizer):
    """Warm-up and capture run real steps over every slot: with a request active they would advance
    its cache position, next token and sample index. On the H200 an engine driven inline captured
    lazily after its first step and then fed a token the sequence never sampled; capture must refuse."""
    dec = ARModelRunner(model, 2, CAPACITY, **dict(zip(("eol_token_id", "visual_token_start_id",
                         "visual_token_end_id"), grid_ids(tokenizer))), exact_rows=False)
    seq = make_seq(model, tokenizer, 0)
    seq.attach_kv_cache(dec.kv_view(0, 1))
    seq.prefill()
    dec.activate(0, seq, 0)
    with pytest.raises(RuntimeError, match="active request"):
        dec.capture()


def _inline_job(model, tokenizer, i: int, key: str):
    from stage_ar.engine import CollectingSink

    w, h = SPECS[i][:2]
    sink, outcome = CollectingSink(), {}
    job = DecodeJob(request_id=key, epoch=0, prompt_ids=make_seq(model, tokenizer, i).prompt_ids, negative_ids=None,
                    ar_width=w, ar_height=h, seed=i, temperature=0, top_k=0, top_p=0,
                    ar_guidance_scale=SPECS[i][4], sink=sink, on_progress=lambda a, b: None,
                    on_done=lambda exc, stats: outcome.setdefault("error", exc))
    return job, sink, outcome


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA graphs and the GPU paths")
@pytest.mark.parametrize(("dtype", "padded"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["fp32-padded", "bf16-padded", "bf16-buckets"])
def test_inline_engine_on_cuda_alone_equals_batched(model, tokenizer, padded, dtype):
    """The benchmark's check on the real GPU path (graphs, compile, Triton attention and GEMV, padded
    and bucket mode): a request driven inline (`step` first, as `benchmarks/ar_decode.py` does)
    finishes without a bookkeeping error, and its rows are bit-identical alone and inside a
    staggered batch (bucket mode: batch 1 alone, 2..8 batched, so every GEMV runs at another M).

    Not claimed: float32 bucket mode on the GPU (on the H200, 2026-12-01, its rows differed alone and
    batched; the cause is not found yet). The served mode is the padded one, batch-invariant in both
    dtypes; bf16 bucket mode held too."""
    import copy

    gpu_model = copy.deepcopy(model).to("cuda", dtype)

    def factory(job: DecodeJob) -> T2ISequence:
        return make_seq(gpu_model, tokenizer, job.seed)

    def run(joins: dict[int, list]) -> None:
        engine = DecodeEngine(factory, 8, model=gpu_model, grid_ids=grid_ids(tokenizer),
                              max_sequence_length=CAPACITY, batch_invariant=padded, kv_slots=8)
        for step in range(max(joins) + 1):
            for job, _, _ in joins.get(step, []):
                engine.submit(job)
            engine.step()
        engine.run_until_idle()

    alone = _inline_job(gpu_model, tokenizer, 0, "alone")
    run({0: [alone]})
    target = _inline_job(gpu_model, tokenizer, 0, "target")
    others = [_inline_job(gpu_model, tokenizer, i, f"o{i}") for i in range(1, len(SPECS))]
    run({0: others[:2], 2: [target] + others[2:3], 4: others[3:]})
    for _, sink, outcome in [alone, target, *others]:
        assert outcome["error"] is None and sink.finished
    assert alone[1].token_ids[Role.CONDITION] == target[1].token_ids[Role.CONDITION]
    assert torch.equal(alone[1].hidden(), target[1].hidden())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: graphs, compile, Triton kernels"))])
def test_a_dropped_engine_frees_its_kv_pool(model, tokenizer, device):
    """An engine that has served a request and is dropped leaves nothing alive: its KV pool (and
    with it the graphs' memory) is freed. On the H200 `benchmarks/ar_decode.py` showed each engine
    variant in one process adding about one KV pool (1.8 GiB) to the peak — this is the check for it
    (it passes on the CPU; the CUDA case is the one to watch)."""
    import copy
    import gc
    import weakref

    m = copy.deepcopy(model).to(device) if device == "cuda" else model

    def factory(job: DecodeJob) -> T2ISequence:
        return make_seq(m, tokenizer, job.seed)

    engine = DecodeEngine(factory, 8, model=m, grid_ids=grid_ids(tokenizer), max_sequence_length=CAPACITY,
                          kv_slots=8, decoder_options={} if device == "cuda" else {"exact_rows": False})
    job, sink, outcome = _inline_job(m, tokenizer, 0, "drop")
    engine.submit(job)
    engine.step()
    engine.run_until_idle()
    assert outcome["error"] is None and sink.finished
    pool, key = weakref.ref(engine.runner.pool), weakref.ref(engine.runner.pool.key)
    del engine, job, sink, outcome
    gc.collect()
    assert pool() is None and key() is None, [type(r).__name__ for r in gc.get_referrers(key())] if key() else None


def test_a_finished_job_does_not_keep_its_engine_alive(model, tokenizer):
    """A job its caller still holds after it finished (a request's session, the benchmark's job list)
    does not keep the engine, its KV pool and graphs alive: the engine's cancel callback leaves the
    job with it. On the H200 the benchmark's engine variants overlapped in memory by one KV pool
    (1.8 GiB at Preview size) because each variant's finished jobs still referenced their engine."""
    import gc
    import weakref

    def factory(job: DecodeJob) -> T2ISequence:
        return make_seq(model, tokenizer, job.seed)

    engine = DecodeEngine(factory, 8, model=model, grid_ids=grid_ids(tokenizer), max_sequence_length=CAPACITY,
                          kv_slots=8, decoder_options={"exact_rows": False})
    job, sink, outcome = _inline_job(model, tokenizer, 0, "kept")
    engine.submit(job)
    engine.run_until_idle()
    assert outcome["error"] is None and sink.finished
    pool = weakref.ref(engine.runner.pool)
    del engine
    gc.collect()
    assert pool() is None, "the finished job still references its engine"
    job.cancel()  # cancelling a finished job is still safe (nothing to abort)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture streams and cuBLAS workspaces")
def test_engines_built_one_after_another_do_not_grow_gpu_memory(model, tokenizer):
    """Building, using and dropping engines one after another in one process (benchmarks, tests, a
    restarted engine) leaves the GPU memory where the first one left it. Each runner used to capture
    its graphs after warming up on a new ``torch.cuda.Stream``; PyTorch keeps a cuBLAS workspace per
    stream for the life of the process, so every engine whose step calls cuBLAS (here the fixture
    model's torch linear backend) left 32 MiB behind on the H200 (`mammoth_core.cuda_streams`)."""
    import copy
    import gc

    m = copy.deepcopy(model).to("cuda")

    def factory(job: DecodeJob) -> T2ISequence:
        return make_seq(m, tokenizer, job.seed)

    after = []
    for n in range(3):
        engine = DecodeEngine(factory, 8, model=m, grid_ids=grid_ids(tokenizer), max_sequence_length=CAPACITY,
                              kv_slots=8, decoder_options={"fused_attention": False, "compile": False})
        job, sink, outcome = _inline_job(m, tokenizer, 0, f"again-{n}")
        engine.submit(job)
        engine.step()
        engine.run_until_idle()
        assert outcome["error"] is None and sink.finished
        del engine, job, sink, outcome
        gc.collect()
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    # the first engine may leave process-wide one-time state (the default stream's workspace); the
    # ones after it must not add to it
    assert after[2] == after[1], [a / 2**20 for a in after]


def test_a_fault_of_the_decode_loop_fails_every_job_and_refuses_new_ones(model, tokenizer):
    """A fault outside any one request's prefill or step (on the GPU: a CUDA error surfacing when the
    loop reads a launched step's ids back) used to end the decode thread silently: the running
    requests never got ``on_done``, their callers (the gRPC handlers) waited forever, and `submit` kept accepting work nobody would do. Now each is failed
    with the reason and its sink aborted, new work is refused, and ``on_failure`` runs once (the
    server turns its health NOT_SERVING)."""
    from stage_ar.scheduler import EngineStopped

    failures: list[BaseException] = []

    def factory(job: DecodeJob) -> T2ISequence:
        return make_seq(model, tokenizer, job.seed)

    engine = DecodeEngine(factory, 2, model=model, grid_ids=grid_ids(tokenizer), max_sequence_length=CAPACITY,
                          on_failure=failures.append)

    def broken_collect(pending):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    done: dict[str, BaseException | None] = {}
    finished = threading.Event()

    def job_for(i: int, sink) -> DecodeJob:
        w, h = SPECS[i][:2]
        return DecodeJob(
            request_id=f"job{i}", epoch=0, prompt_ids=make_seq(model, tokenizer, i).prompt_ids, negative_ids=None,
            ar_width=w, ar_height=h, seed=i, temperature=0, top_k=0, top_p=0, ar_guidance_scale=SPECS[i][4],
            sink=sink, on_progress=lambda a, b: None,
            on_done=lambda exc, stats, rid=f"job{i}": (done.__setitem__(rid, exc), finished.set()),
        )

    sinks = [RecordingSink(), RecordingSink()]
    engine.start()
    try:
        assert engine.ready.wait(30)
        engine.runner.collect = broken_collect  # the next step's read-back fails
        engine.submit(job_for(0, sinks[0]))
        engine.submit(job_for(3, sinks[1]))
        deadline = time.monotonic() + 30
        while len(done) < 2 and time.monotonic() < deadline:
            if finished.wait(0.05):
                finished.clear()  # else the set event makes this loop spin, starving the engine thread
        assert set(done) == {"job0", "job3"}, f"jobs that never finished: {({'job0', 'job3'} - set(done))}"
        assert all("illegal memory access" in str(exc) for exc in done.values()), done
        assert all(s.aborted and not s.finished for s in sinks)
        assert len(failures) == 1 and engine.failure is failures[0]
        with pytest.raises(EngineStopped):
            engine.submit(job_for(1, RecordingSink()))
    finally:
        engine.stop()
