"""Exploration: an FP8 (E4M3) weight-streaming GEMV on CUDA cores (no ``tl.dot``) against the project's
tensor-core GEMV (`stage_ar.gemv.gemv`) at the MammothModa2-Preview AR shapes.

Hypothesis. `stage_ar.gemv` widens FP8 codes in registers and multiplies with ``tl.dot`` (mma.sync,
activations padded to a 16-row tile); on the H200 (copy bandwidth ~4.2 TB/s) that streams only
1.2-2.75 TB/s of FP8 bytes, so FP8 weights are no faster than bf16. A kernel that loads each FP8
weight tile straight into registers, widens it to float32 and, for each activation row, multiplies
and reduces along K on CUDA cores (no operand layout conversions for the tensor cores) should stream
FP8 at a much higher fraction of the bandwidth for small M (1..8). At M = 16 it does 16 FMAs per
weight byte, ~128 TFLOP/s at 4 TB/s, above the H200's ~67 TFLOP/s of fp32: expect it to fall behind there.

The kernel (`fp8_gemv_cuda_core`): ``out (M, N) = x (M, K) @ (w_fp8 (N, K) * scale[:, None]).T (+ bias)``.
Each program owns ``block_n`` output rows (weight rows) and walks all of K in ``block_k`` tiles (no
split-K). Per tile it loads the ``(block_n, block_k)`` FP8 codes, widens them to float32 once, then
for each activation row ``m`` in ``range(M)`` (runtime M, a loop) adds ``tl.sum(w * x_m, axis=1)`` to
column ``m`` of a ``(block_n, 16)`` float32 accumulator (``tl.where`` on the column index): the
instructions a row goes through do not depend on M, so a row alone and the same row inside any batch
give the same bits (batch invariance by construction). Epilogue: ``acc * scale[n] (+ bias[n])`` in
float32, rounded once to x's dtype. Flags: ``unroll=2`` loads two K tiles per iteration (more bytes
in flight per program; same per-row summation order as ``unroll=1``: tile after tile),
``prefetch=True`` loads the next iteration's tile(s) into registers before working on the current
one (a register double buffer), ``late_reduce=True`` keeps per-16-column-group partial sums in a
``(block_n, block_k / 16, 16)`` accumulator (in-thread adds per row and tile) and reduces across the
groups (across threads) once after the K loop instead of once per row and tile.

What a GPU run measures (``PYTHONPATH=. python3 benchmarks/gemv_fp8_cuda_core.py --out "$OUT"``,
about 25 s on an H200 after the machine's start, 12 s of it compiling; ``--budget-s``, default 200,
stops starting new timings):
0. a process pool compiles every candidate launch (ours and `stage_ar.gemv`'s autotuning candidates);
1. ceiling: device-to-device copy bandwidth (`benchmarks/gemv.copy_bandwidth`);
2. per shape (qkv with bias, o, gate_up, down, head; `benchmarks/gemv.shapes`): weight copies whose FP8
   bytes exceed 4 x L2 (`benchmarks/gemv.make_weights`), each call on its own copy, all copies' calls
   in one CUDA graph, replayed (`benchmarks/gemv.graph_ms_per_call`);
   a. every candidate of `CONFIGS` checked at M = 16 (max abs error vs the float32 reference relative
      to the output's max abs, beside the same measure of the reference's own bf16 rounding; every row
      alone, rows 3..7 as M = 5 and the first 2, 4, 8 rows bit for bit equal to the M = 16 rows),
      then timed at M = 1;
   b. the three fastest correct ones at M = 1, 2, 4, 8, 16; the M = 1 pick is the fixed launch a
      server would use (one launch for every M keeps a row's bits; it is the table's number), the best of
      the three at each M is recorded too;
   c. side by side at every M: `stage_ar.gemv.gemv` with the same FP8 weights (default
      ``fp8_compute``, autotuned), with the bf16 weights, and cuBLAS bf16 (``F.linear``);
3. per visual token: 28 x (qkv + o + gate_up + down) + 1 x head, ms per path and M, with the FP8 and
   bf16 HBM floors (weight bytes / copy bandwidth).
``gemv_fp8_cuda_core.json`` in ``--out`` is rewritten after each shape (a timeout keeps what finished);
markdown tables are printed at the end.

Result (H200, 2026-12-02, triton 3.6, copy bandwidth 4.19 TB/s; per visual token, ms; FP8 floor 1.57):
at M = 1 ours 2.90 (fixed M = 1 pick per shape; 1.6-2.4 TB/s of FP8 bytes, mostly ``late_reduce``
launches) against `stage_ar.gemv` FP8 3.37 and bf16 3.48, so 14 % faster but still 1.8 x the floor;
at M = 2, 4, 8, 16 ours 4.45, 7.79, 14.4, 27.6 against a flat 3.35-3.37 (FP8) and 3.48-3.54 (bf16):
each extra row adds about 1.65 ms per token (CUDA-core arithmetic, not bytes). Every launch matched the reference within
bf16 rounding and was batch invariant. ``prefetch`` and ``num_stages`` 3 gained nothing.

``--smoke``: tiny shapes (K = 96 -> N = 40 with bias, K = 200 -> N = 24), float32 activations, under
Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set below before triton is imported):
correctness and batch invariance of a few launches only, no timing; seconds.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter is chosen when triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:  # CPU-only installs of torch have no triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

FP8_DTYPE = torch.float8_e4m3fn
MAX_ROWS = 16  # activation rows one launch takes (the accumulator's columns)
MS = (1, 2, 4, 8, 16)
BF16_ULP = 2.0**-7  # relative spacing of bf16 at 1


@dataclasses.dataclass(frozen=True)
class CCConfig:
    """One launch of `fp8_gemv_cuda_core` (every size a power of two)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    unroll: int = 1
    prefetch: bool = False
    late_reduce: bool = False

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return (f"bn{self.block_n}-bk{self.block_k}-w{self.num_warps}-s{self.num_stages}"
                + (f"-u{self.unroll}" if self.unroll > 1 else "") + ("-pf" if self.prefetch else "")
                + ("-late" if self.late_reduce else ""))


#: The GPU sweep (24 launches). Base launches hold 16 or 32 FP8 bytes per thread per tile
#: (``block_n * block_k / (32 * num_warps)``: 16 is one 16-byte vector load, so no thread is idle and
#: no element replicated); the unrolled and prefetching ones start from the 16-byte bases (32 bytes
#: in flight per thread, as the 32-byte bases, but in two loads); ``late_reduce`` launches from the
#: fastest bases; one probe of ``num_stages`` 3 (the nested M loop keeps Triton's pipeliner off: on
#: the H200, 2 such probes timed as their ``num_stages`` 1 twins). Left out after a first H200 run:
#: the 1024-column tiles with 8 warps and two prefetching launches (slowest at every shape).
CONFIGS = (
    # 2 warps
    CCConfig(4, 256, 2), CCConfig(8, 256, 2), CCConfig(4, 512, 2),
    # 4 warps
    CCConfig(8, 256, 4), CCConfig(4, 512, 4), CCConfig(16, 256, 4), CCConfig(8, 512, 4), CCConfig(4, 1024, 4),
    # 8 warps
    CCConfig(16, 256, 8), CCConfig(8, 512, 8), CCConfig(32, 256, 8), CCConfig(16, 512, 8),
    # two K tiles per iteration
    CCConfig(4, 256, 2, unroll=2), CCConfig(8, 256, 4, unroll=2), CCConfig(4, 512, 4, unroll=2),
    CCConfig(8, 512, 8, unroll=2),
    # next tile loaded before the current one is used
    CCConfig(4, 256, 2, prefetch=True), CCConfig(4, 512, 4, prefetch=True),
    # one cross-thread reduction per row at the end instead of one per row and tile
    CCConfig(4, 512, 2, late_reduce=True), CCConfig(4, 512, 4, late_reduce=True),
    CCConfig(8, 512, 8, late_reduce=True), CCConfig(8, 256, 4, unroll=2, late_reduce=True),
    CCConfig(4, 256, 2, unroll=2, late_reduce=True),
    # software-pipeline probe
    CCConfig(4, 512, 4, num_stages=3),
)
#: ``--smoke``'s launches: partial K tiles (K = 96, 200), partial row blocks (N = 40, 24), both flags.
SMOKE_CONFIGS = (
    CCConfig(8, 32, 2), CCConfig(16, 64, 4, unroll=2, late_reduce=True), CCConfig(16, 32, 2, prefetch=True),
    CCConfig(8, 64, 4, unroll=2, prefetch=True), CCConfig(8, 32, 2, late_reduce=True),
)


if triton is not None:
    from stage_ar.gemv import _w_tile  # noqa: E402 - the weight-tile load of the serving kernel (one home)

    @triton.jit
    def _x_row(x_ptr, k, K, EVEN_K: tl.constexpr):
        """One activation row's ``(BLOCK_K,)`` columns ``k`` as float32 (zeros past K)."""
        if EVEN_K:
            x = tl.load(x_ptr + k)
        else:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        return x.to(tl.float32)

    @triton.jit(do_not_specialize=["M"])
    def _fp8_gemv_cc_kernel(
        x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
        M, N, K, stride_xm, stride_om,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr, LATE_REDUCE: tl.constexpr = False,
    ):
        """Rows ``[pid * BLOCK_N, +BLOCK_N)`` of the output's columns: ``out[m, n] = round(scale[n] *
        sum_k x[m, k] * float(w[n, k]) (+ bias[n]))`` for ``m < M <= 16``. ``EVEN_K``: K is a multiple of
        ``UNROLL * BLOCK_K`` (no K mask); ``EVEN_N``: N a multiple of ``BLOCK_N``. The accumulator is
        ``(BLOCK_N, 16)`` float32, column ``m`` row ``m``'s sums: per K tile, ``acc[:, m] += tl.sum(w *
        x_m)``, the same instructions for every ``m`` whatever M is. ``LATE_REDUCE``: per tile only the 16
        contiguous K columns of each group are summed (``(BLOCK_N, BLOCK_K / 16)`` partial sums, in-thread
        where a thread holds 16 contiguous codes), accumulated in a ``(BLOCK_N, BLOCK_K / 16, 16)``
        array (row ``m`` in the last axis), and the groups are summed once after the K loop: no
        cross-thread reduction per row and tile."""
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rows < N
        offs_k = tl.arange(0, BLOCK_K)
        cols = tl.arange(0, 16)
        acc = tl.zeros((BLOCK_N, 16), tl.float32)
        GROUPS: tl.constexpr = BLOCK_K // 16
        if LATE_REDUCE:
            acc3 = tl.zeros((BLOCK_N, GROUPS, 16), tl.float32)  # [row n, K group, activation row m]
            m3 = tl.arange(0, 16)[None, None, :]
        if PREFETCH:  # the first iteration's tiles (a partial K tile is masked whenever K is not even)
            next_a = _w_tile(w_ptr, rows, n_mask, offs_k, K, EVEN_K, EVEN_N)
            if UNROLL == 2:
                next_b = _w_tile(w_ptr, rows, n_mask, offs_k + BLOCK_K, K, EVEN_K, EVEN_N)
        for k0 in range(0, K, UNROLL * BLOCK_K):
            ka = k0 + offs_k
            kb = ka + BLOCK_K
            if PREFETCH:
                wa = next_a.to(tl.float32)
                # the next iteration's tiles: past the end on the last one, so always masked
                next_a = _w_tile(w_ptr, rows, n_mask, ka + UNROLL * BLOCK_K, K, False, EVEN_N)
                if UNROLL == 2:
                    wb = next_b.to(tl.float32)
                    next_b = _w_tile(w_ptr, rows, n_mask, kb + UNROLL * BLOCK_K, K, False, EVEN_N)
            else:
                wa = _w_tile(w_ptr, rows, n_mask, ka, K, EVEN_K, EVEN_N).to(tl.float32)
                if UNROLL == 2:
                    wb = _w_tile(w_ptr, rows, n_mask, kb, K, EVEN_K, EVEN_N).to(tl.float32)
            for m in range(M):
                x_row = x_ptr + m * stride_xm
                if LATE_REDUCE:
                    hit3 = m3 == m
                    prod = wa * _x_row(x_row, ka, K, EVEN_K)[None, :]
                    part3 = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, 16)), axis=2)
                    acc3 = tl.where(hit3, acc3 + part3[:, :, None], acc3)
                    if UNROLL == 2:
                        prod_b = wb * _x_row(x_row, kb, K, EVEN_K)[None, :]
                        part3_b = tl.sum(tl.reshape(prod_b, (BLOCK_N, GROUPS, 16)), axis=2)
                        acc3 = tl.where(hit3, acc3 + part3_b[:, :, None], acc3)
                else:
                    part = tl.sum(wa * _x_row(x_row, ka, K, EVEN_K)[None, :], axis=1)
                    hit = cols[None, :] == m
                    acc = tl.where(hit, acc + part[:, None], acc)
                    if UNROLL == 2:  # tile b after tile a: the order unroll=1 takes
                        part_b = tl.sum(wb * _x_row(x_row, kb, K, EVEN_K)[None, :], axis=1)
                        acc = tl.where(hit, acc + part_b[:, None], acc)
        if LATE_REDUCE:
            acc = tl.sum(acc3, axis=1)
        scale = tl.load(scale_ptr + rows, mask=n_mask, other=0.0)
        y = acc * scale[:, None]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out_mask = n_mask[:, None] & (cols < M)[None, :]
        tl.store(out_ptr + cols[None, :] * stride_om + rows[:, None], y.to(dtype), mask=out_mask)


def _pow2(name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")


def _meta(n: int, k: int, has_bias: bool, block_n: int, block_k: int, unroll: int, prefetch: bool,
          late_reduce: bool = False) -> dict:
    """The kernel's compile-time arguments for one launch."""
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll, PREFETCH=bool(prefetch),
                EVEN_K=k % (unroll * block_k) == 0, EVEN_N=n % block_n == 0, HAS_BIAS=bool(has_bias),
                LATE_REDUCE=bool(late_reduce))


def fp8_gemv_cuda_core(x: torch.Tensor, w_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                       block_n: int, block_k: int, num_warps: int, num_stages: int, unroll: int = 1,
                       prefetch: bool = False, late_reduce: bool = False) -> torch.Tensor:
    """``x @ (w_fp8.float() * scale[:, None]).T (+ bias)`` on CUDA cores, float32 sums, rounded to x's dtype.

    Args:
        x: ``(M, K)`` activations, ``1 <= M <= 16``, bfloat16/float16/float32, rows contiguous.
        w_fp8: ``(N, K)`` ``torch.float8_e4m3fn`` codes, contiguous (`stage_ar.fp8.quantize_fp8_per_channel`).
        scale: ``(N,)`` float32 per-row scales.
        bias: ``(N,)`` in any float dtype (added in float32), or None.
        block_n: weight rows (output columns) per program, a power of two.
        block_k: K columns per tile, a power of two (>= 16 keeps one 16-byte load per thread row).
        num_warps, num_stages: Triton launch parameters.
        unroll: K tiles loaded per loop iteration (1 or 2).
        prefetch: load the next iteration's tile(s) before using the current ones.
        late_reduce: sum each row's products within 16-column groups per tile and across the groups
            once at the end (``block_k >= 16``); another summation order than without it.

    Returns:
        ``(M, N)`` in ``x.dtype``, a new tensor. A row's bits depend on the launch (block and warp
        sizes), never on M or on the other rows.
    """
    if triton is None:
        raise RuntimeError("fp8_gemv_cuda_core needs triton")
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.stride(1) != 1:
        raise ValueError(f"x must be (M, K) with 1 <= M <= {MAX_ROWS} and contiguous rows, got {tuple(x.shape)}")
    m, k = x.shape
    if w_fp8.dtype != FP8_DTYPE or w_fp8.ndim != 2 or w_fp8.shape[1] != k or not w_fp8.is_contiguous():
        raise ValueError(f"w_fp8 must be a contiguous (N, {k}) {FP8_DTYPE}, got {tuple(w_fp8.shape)} {w_fp8.dtype}")
    n = w_fp8.shape[0]
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be ({n},) float32, got {tuple(scale.shape)} {scale.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be ({n},), got {tuple(bias.shape)}")
    for name, value in (("block_n", block_n), ("block_k", block_k), ("num_warps", num_warps)):
        _pow2(name, value)
    if unroll not in (1, 2):
        raise ValueError(f"unroll must be 1 or 2, got {unroll}")
    if block_k < 16:
        raise ValueError(f"block_k must be >= 16, got {block_k}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_cc_kernel[(triton.cdiv(n, block_n),)](
        x, w_fp8, scale, out if bias is None else bias, out, m, n, k, x.stride(0), out.stride(0),
        num_warps=num_warps, num_stages=num_stages,
        **_meta(n, k, bias is not None, block_n, block_k, unroll, prefetch, late_reduce),
    )
    return out


def reference(x: torch.Tensor, w_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 ``x.float() @ (w_fp8.float() * scale[:, None]).T (+ bias)``, ``(M, N)``."""
    y = x.float() @ (w_fp8.float() * scale[:, None]).T
    return y + bias.float() if bias is not None else y


def check_launch(x16: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, cfg: CCConfig,
                 want16: torch.Tensor | None = None, tol: float = BF16_ULP, alone_rows=range(16)) -> dict:
    """Accuracy and batch invariance of one launch.

    Args:
        x16: ``(16, K)`` activations; w8 ``(N, K)`` E4M3, scale ``(N,)`` float32, bias ``(N,)`` or None.
        want16: `reference` of all 16 rows (computed here when None).
        tol: the largest accepted ``max |out - ref| / max |ref|`` (bf16: one ulp at the largest output).
        alone_rows: the rows launched alone (row 0 always is: it gives the M = 1 error).

    Returns:
        ``rel_max_err`` at M = 16 and M = 1, ``ref_rounding_err`` (the same measure of the reference
        rounded to x's dtype: what rounding alone costs), ``rows_alone_equal`` (each of ``alone_rows``
        launched alone equals its row of the M = 16 launch bit for bit), ``slice_equal`` (rows 3..7 as M = 5, and
        the first 2, 4, 8 rows as M = 2, 4, 8, equal to theirs), ``ok``.
    """
    if want16 is None:
        want16 = reference(x16, w8, scale, bias)
    full = fp8_gemv_cuda_core(x16, w8, scale, bias, **cfg.kwargs())
    denom = float(want16.abs().max()) or 1.0
    rel16 = float((full.float() - want16).abs().max()) / denom
    rounding = float((want16.to(x16.dtype).float() - want16).abs().max()) / denom
    rows = sorted({0, *alone_rows})
    alone = {i: fp8_gemv_cuda_core(x16[i : i + 1], w8, scale, bias, **cfg.kwargs()) for i in rows}
    rel1 = float((alone[0].float() - want16[:1]).abs().max()) / (float(want16[:1].abs().max()) or 1.0)
    rows_alone = all(torch.equal(a[0], full[i]) for i, a in alone.items())
    slices = torch.equal(fp8_gemv_cuda_core(x16[3:8], w8, scale, bias, **cfg.kwargs()), full[3:8]) and all(
        torch.equal(fp8_gemv_cuda_core(x16[:m], w8, scale, bias, **cfg.kwargs()), full[:m]) for m in (2, 4, 8))
    return dict(rel_max_err_M16=rel16, rel_max_err_M1=rel1, ref_rounding_err=rounding, rows_alone_equal=rows_alone,
                slice_equal=slices,
                ok=bool(rel16 <= tol and rel1 <= tol and rows_alone and slices))


# ---------------------------------------------------------------------------------------------- smoke


def smoke(out: pathlib.Path) -> dict:
    """Correctness and invariance of `SMOKE_CONFIGS` on tiny shapes under the interpreter (CPU)."""
    from stage_ar.fp8 import quantize_fp8_per_channel

    res: dict = {"mode": "smoke", "interpreted": os.environ.get("TRITON_INTERPRET") == "1", "checks": {}}
    g = torch.Generator().manual_seed(0)
    for name, (k, n, with_bias) in {"k96_n40_bias": (96, 40, True), "k200_n24": (200, 24, False)}.items():
        w8, scale = quantize_fp8_per_channel(torch.randn(n, k, generator=g) / k**0.5)
        bias = 0.1 * torch.randn(n, generator=g) if with_bias else None
        x = torch.randn(16, k, generator=g)
        want = reference(x, w8, scale, bias)
        for cfg in SMOKE_CONFIGS if with_bias else SMOKE_CONFIGS[:2]:  # the interpreter is slow
            rec = check_launch(x, w8, scale, bias, cfg, want, tol=1e-5)
            res["checks"][f"{name}/{cfg}"] = rec
            print(f"smoke {name:13s} {str(cfg):28s} {json.dumps(rec)}", flush=True)
    res["all_ok"] = all(r["ok"] for r in res["checks"].values())
    (out / "gemv_fp8_cuda_core.json").write_text(json.dumps(res, indent=2))
    print("| launch | rel err M=16 | rel err M=1 | rows alone = M=16 | slices = M=16 |\n| --- | ---: | ---: | --- | --- |")
    for key, r in res["checks"].items():
        print(f"| {key} | {r['rel_max_err_M16']:.2e} | {r['rel_max_err_M1']:.2e} | {r['rows_alone_equal']} | "
              f"{r['slice_equal']} |")
    print("smoke", "OK" if res["all_ok"] else "FAILED", flush=True)
    return res


# ---------------------------------------------------------------------------------------------- GPU


def _compile_cc(job: tuple) -> tuple[str, float, str | None]:
    """Compile one of our launches (a process-pool job: ``(key, N, K, has_bias, CCConfig)``)."""
    key, n, k, has_bias, cfg = job
    t = time.time()
    try:
        _fp8_gemv_cc_kernel.warmup(
            torch.bfloat16, FP8_DTYPE, torch.float32, torch.bfloat16, torch.bfloat16, MAX_ROWS, n, k, k, n,
            grid=(1,), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **_meta(n, k, has_bias, cfg.block_n, cfg.block_k, cfg.unroll, cfg.prefetch, cfg.late_reduce),
        )
        return key, time.time() - t, None
    except Exception as exc:  # noqa: BLE001 - the timing call compiles (or fails) it again
        return key, time.time() - t, f"{type(exc).__name__}: {str(exc)[:200]}"


def _compile_job(job: tuple) -> tuple[str, float, str | None]:
    """A pool job: ours (``"cc"``) or `stage_ar.gemv`'s (``"gemv"``, as `benchmarks/gemv._compile_job`)."""
    kind, payload = job
    if kind == "cc":
        return _compile_cc(payload)
    import gemv as B

    return B._compile_job(payload)


def precompile(table: dict, workers: int) -> dict:
    """Compile our candidates and `stage_ar.gemv`'s autotuning candidates (FP8 and bf16, plain + bias
    where the shape has one) in a pool of processes (Triton compiles serially within one)."""
    import gemv as B
    from stage_ar import gemv as G

    jobs, seen = [], set()
    for name, s in table.items():
        n, k, has_bias = s["rows"], s["K"], _has_bias(s)
        for cfg in CONFIGS:
            meta = _meta(n, k, has_bias, cfg.block_n, cfg.block_k, cfg.unroll, cfg.prefetch, cfg.late_reduce)
            spec = (n % 16 == 0, k % 16 == 0, cfg, tuple(sorted(meta.items())))  # what Triton specialises on
            if spec not in seen:
                seen.add(spec)
                jobs.append(("cc", (f"{name}/cc/{cfg}", n, k, has_bias, cfg)))
        flags = {"bias": True} if has_bias else {}
        for w_dtype, configs in ((G.FP8_DTYPE, G.FP8_TUNED_CONFIGS), (torch.bfloat16, G.TUNED_CONFIGS)):
            for c in configs:
                if G.fits_shared_memory(c, torch.bfloat16, w_dtype):
                    jobs.append(("gemv", (f"{name}/gemv/{w_dtype}/{c}", torch.bfloat16, w_dtype, n, k, c, flags)))
    return B.run_compile_jobs(jobs, workers, _compile_job)


def _has_bias(shape: dict) -> bool:
    return bool(shape["fused"].get("bias"))


def _timed(calls: list, nbytes: int) -> dict:
    """`benchmarks/gemv.graph_ms_per_call` of ``calls`` as ``{ms, TBps, timing}`` (TB/s of ``nbytes`` per call)."""
    import gemv as B

    ms, how = B.graph_ms_per_call(calls)
    return dict(ms=ms, TBps=nbytes / (ms / 1e3) / 1e12, timing=how)


def _cc_calls(sets: list[dict], x: torch.Tensor, with_bias: bool, cfg: CCConfig) -> list:
    return [(lambda ws=ws: fp8_gemv_cuda_core(x, ws["w8"], ws["scale"], ws["bias"] if with_bias else None,
                                               **cfg.kwargs())) for ws in sets]


def _baseline_calls(path: str, sets: list[dict], x: torch.Tensor, with_bias: bool) -> list:
    import torch.nn.functional as F

    from stage_ar import gemv as G

    def one(ws):
        bias = ws["bias"] if with_bias else None
        if path == "gemv_fp8":
            return lambda: G.gemv(x, ws["w8"], weight_scale=ws["scale"], bias=bias)
        if path == "gemv_bf16":
            return lambda: G.gemv(x, ws["w"], bias=bias)
        if path == "cublas_bf16":
            return lambda: F.linear(x, ws["w"], bias)
        raise ValueError(path)

    return [one(ws) for ws in sets]


BASELINES = ("gemv_fp8", "gemv_bf16", "cublas_bf16")
TOP = 3  # our fastest launches at M = 1 timed at every M


def run_shape(name: str, shape: dict, sets: list[dict], deadline: float) -> dict:
    """Sweep, checks and timings of one shape (see the module docstring, step 2)."""
    from stage_ar import gemv as G

    k, n, with_bias = shape["K"], shape["rows"], _has_bias(shape)
    fp8_bytes = n * k
    x16 = torch.randn(16, k, device="cuda", generator=torch.Generator("cuda").manual_seed(7)).to(torch.bfloat16)
    ws0 = sets[0]
    want16 = reference(x16, ws0["w8"], ws0["scale"], ws0["bias"] if with_bias else None)
    rec: dict = {"K": k, "N": n, "bias": with_bias, "copies": len(sets), "fp8_MB": fp8_bytes / 1e6, "sweep": {}}
    # a. every candidate: checks, then M = 1 time
    for cfg in CONFIGS:
        if time.time() > deadline:
            rec["sweep"][str(cfg)] = "skipped: time budget"
            continue
        try:
            chk = check_launch(x16, ws0["w8"], ws0["scale"], ws0["bias"] if with_bias else None, cfg, want16)
            cell = dict(check=chk)
            if chk["ok"]:
                cell["M1"] = _timed(_cc_calls(sets, x16[:1], with_bias, cfg), fp8_bytes)
            rec["sweep"][str(cfg)] = cell
            t1 = cell.get("M1", {})
            print(f"sweep {name:8s} {str(cfg):28s} ok={chk['ok']} err={chk['rel_max_err_M16']:.1e} "
                  + (f"M1 {t1['ms'] * 1e3:7.1f} us {t1['TBps']:.2f} TB/s" if t1 else ""), flush=True)
        except Exception as exc:  # noqa: BLE001 - one failing launch must not end the run
            rec["sweep"][str(cfg)] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            print(f"sweep {name:8s} {cfg} error", flush=True)
            traceback.print_exc()
    ranked = sorted((c for c in CONFIGS if isinstance(rec["sweep"].get(str(c)), dict) and "M1" in rec["sweep"][str(c)]),
                    key=lambda c: rec["sweep"][str(c)]["M1"]["ms"])
    top = ranked[:TOP]
    rec["pick"] = str(top[0]) if top else None
    rec["top"] = [str(c) for c in top]
    # b + c. every M: our top launches and the baselines
    rec["timings"] = {}
    for m in MS:
        row: dict = {}
        x = x16[:m]
        for cfg in top:
            key = f"cc/{cfg}"
            if m == 1:
                row[key] = rec["sweep"][str(cfg)]["M1"]
            elif time.time() > deadline:
                row[key] = "skipped: time budget"
            else:
                try:
                    row[key] = _timed(_cc_calls(sets, x, with_bias, cfg), fp8_bytes)
                except Exception as exc:  # noqa: BLE001
                    row[key] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        for path in BASELINES:
            if time.time() > deadline:
                row[path] = "skipped: time budget"
                continue
            try:
                row[path] = _timed(_baseline_calls(path, sets, x, with_bias), fp8_bytes * (1 if "fp8" in path else 2))
                if path.startswith("gemv"):
                    row[f"{path}_config"] = str(G.last_tuned_config())
            except Exception as exc:  # noqa: BLE001
                row[path] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
        ours = {key: v for key, v in row.items() if key.startswith("cc/") and isinstance(v, dict)}
        if top and isinstance(row.get(f"cc/{top[0]}"), dict):
            row["cc_pick"] = row[f"cc/{top[0]}"] | {"config": str(top[0])}
        if ours:
            best = min(ours, key=lambda key: ours[key]["ms"])
            row["cc_best"] = ours[best] | {"config": best[3:]}
        rec["timings"][f"M{m}"] = row
        print(f"time  {name:8s} M={m:2d} " + "  ".join(
            f"{p}={row[p]['ms'] * 1e3:.1f}us/{row[p]['TBps']:.2f}TB/s" if isinstance(row.get(p), dict) else f"{p}=-"
            for p in ("cc_pick", "cc_best") + BASELINES), flush=True)
    # the pick's check on another weight copy's errors is the same kernel: recorded once, in the sweep
    if top:
        rec["pick_check"] = rec["sweep"][str(top[0])]["check"]
    return rec


PATHS = ("cc_pick", "cc_best") + BASELINES


def per_token(results: dict, table: dict, bandwidth: float) -> dict:
    """ms per visual token (sum over shapes of ms x calls per token) per path and M, and the floors."""
    bytes8 = sum(s["rows"] * s["K"] * s["per_token"] for s in table.values())
    out: dict = {"floor_fp8_ms": bytes8 / bandwidth * 1e3, "floor_bf16_ms": 2 * bytes8 / bandwidth * 1e3,
                 "fp8_weight_GB": bytes8 / 1e9}
    for m in MS:
        sums = {}
        for path in PATHS:
            try:
                sums[path] = sum(results[n]["timings"][f"M{m}"][path]["ms"] * s["per_token"] for n, s in table.items())
            except (KeyError, TypeError):
                sums[path] = None
        out[f"M{m}"] = sums
    return out


def _us(cell) -> str:
    return f"{cell['ms'] * 1e3:.1f} / {cell['TBps']:.2f}" if isinstance(cell, dict) else "-"


def print_tables(res: dict) -> None:
    """Markdown: per shape and M (µs / TB/s of own weight bytes), then per visual token."""
    print(f"\ncopy bandwidth {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write)\n")
    print("| shape | M | ours, M=1 pick (us / TB/s fp8) | ours, best of top 3 | gemv fp8 | gemv bf16 | cuBLAS bf16 |")
    print("| --- | ---: | --- | --- | --- | --- | --- |")
    for name, rec in res["shapes"].items():
        if not isinstance(rec, dict):
            continue
        for m in MS:
            row = rec.get("timings", {}).get(f"M{m}", {})
            best = row.get("cc_best")
            print(f"| {name} | {m} | {_us(row.get('cc_pick'))} {rec.get('pick') or ''} | {_us(best)} "
                  f"{best['config'] if isinstance(best, dict) else ''} | {_us(row.get('gemv_fp8'))} | "
                  f"{_us(row.get('gemv_bf16'))} | {_us(row.get('cublas_bf16'))} |")
    tok = res.get("per_token")
    if tok:
        print(f"\nper visual token (ms); floors: FP8 {tok['floor_fp8_ms']:.3f}, bf16 {tok['floor_bf16_ms']:.3f}\n")
        print("| M | " + " | ".join(PATHS) + " |\n| ---: |" + " ---: |" * len(PATHS))
        for m in MS:
            print(f"| {m} | " + " | ".join(f"{v:.3f}" if v else "-" for v in tok[f"M{m}"].values()) + " |")
    print("\nchecks (M=1 pick per shape): " + ", ".join(
        f"{name}: err {rec['pick_check']['rel_max_err_M16']:.1e} (bf16 rounding of the reference alone "
        f"{rec['pick_check']['ref_rounding_err']:.1e}), invariant "
        f"{rec['pick_check']['rows_alone_equal'] and rec['pick_check']['slice_equal']}"
        for name, rec in res["shapes"].items() if isinstance(rec, dict) and "pick_check" in rec), flush=True)


def gpu(args, out: pathlib.Path) -> dict:
    """The GPU run (module docstring steps 0-3)."""
    import gemv as B  # benchmarks/gemv.py (this script's folder is on sys.path when run as a script)
    from mammoth_app.make_checkpoint import preview_config
    from stage_ar.configuration_mammoth_ar import MammothARConfig

    t0 = time.time()
    deadline = t0 + args.budget_s
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    table = B.shapes(MammothARConfig.from_dict(preview_config()[0]["llm_config"]))
    res: dict = {"command": 'PYTHONPATH=. python3 benchmarks/gemv_fp8_cuda_core.py --out "$OUT"',
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "table": table, "configs": [str(c) for c in CONFIGS], "shapes": {}}

    def save(what: str) -> None:
        res["elapsed_s"] = time.time() - t0
        (out / "gemv_fp8_cuda_core.json").write_text(json.dumps(res, indent=2, default=str))
        print(f"-- {what} done at {res['elapsed_s']:.0f}s", flush=True)

    if args.compile_workers:
        res["precompile"] = precompile(table, args.compile_workers)
        print("precompile", json.dumps(res["precompile"])[:800], flush=True)
        save("precompile")
    res["copy_bandwidth_Bps"] = bandwidth = B.copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    res["L2_bytes"] = torch.cuda.get_device_properties(0).L2_cache_size
    for i, (name, shape) in enumerate(table.items()):
        try:
            sets = B.make_weights(shape, B.weight_copies(shape, weight_bytes=1), seed=i)  # FP8 bytes > 4 x L2
            res["shapes"][name] = run_shape(name, shape, sets, deadline)
        except Exception as exc:  # noqa: BLE001 - the other shapes go on
            res["shapes"][name] = f"error: {type(exc).__name__}: {str(exc)[:400]}"
            traceback.print_exc()
        sets = None
        torch.cuda.empty_cache()
        save(f"shape {name}")
    res["per_token"] = per_token(res["shapes"], table, bandwidth)
    save("per token")
    print_tables(res)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no new timing after this (from the start)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes under the interpreter on the CPU, checks only")
    parser.add_argument("--compile-workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                        help="processes compiling the launches ahead (0: none)")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if triton is None:
        raise SystemExit("triton is not installed")
    if args.smoke:
        res = smoke(out)
        raise SystemExit(0 if res["all_ok"] else 1)
    if not torch.cuda.is_available():
        raise SystemExit("the timing run needs a CUDA GPU (use --smoke on the CPU)")
    gpu(args, out)


if __name__ == "__main__":
    main()
