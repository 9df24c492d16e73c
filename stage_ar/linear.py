"""The AR forward's linear layers and their backends (how ``x @ weight.T + bias`` is computed), chosen
at load; and the optional FP8 weight format of the layers a visual token reads.

`MammothLinear` is ``nn.Linear`` (same parameters, same checkpoint names) whose ``forward`` calls its
``backend``. Its weight is in the model dtype, or, after `MammothLinear.quantize_fp8`, E4M3 codes
with a float32 ``weight_scale (out_features,)`` buffer (`stage_ar.fp8`: ``weight ≈ codes * scale``
per output row). Backends:

* `TorchLinear` (``"torch"``): ``F.linear`` (cuBLAS on CUDA, the CPU's matmul). FP8 codes are
  widened to the activation dtype per call (exact: every E4M3 value is a bfloat16), multiplied in
  that dtype, then scaled per output in float32 and the bias added, rounded once more.
* `GemvLinear` (``"gemv"``): `stage_ar.gemv.gemv` (Triton weight streaming, scale and bias in its
  epilogue) for at most `GemvLinear.max_rows` (16) activation rows, `TorchLinear` above (prefill).

Two layers hand their output straight to a pointwise op: the MLP's ``gate_up_proj`` to SwiGLU
(`MammothLinear.forward_swiglu`) and attention's ``qkv_proj`` to RoPE
(`MammothLinear.forward_rope_qkv`). A backend computes these as linear then the given op
(`LinearBackend`: the op passed in is `stage_ar.layers`' eager or compiled one, the one definition
of the rule); `GemvLinear` with ``fuse_epilogues`` instead runs the op in the GEMV's epilogue (one
launch, no round trip of the linear output through memory) for calls it takes: on by default since
it measured faster on the H200 (docs/PERFORMANCE.md, "Epilogue fusions").

A layer's pre-norms also go through the backend of the projection that reads them (`norm_input`):
the norm module's kernels, except `GemvLinear` under W8A8, whose quantizer launch also adds the
residual and normalises (`QuantizedRows`), one launch where there were two. The MLP is one backend
call too (`LinearBackend.mlp`): under W8A8 with ``"amax"`` fused (opt-in: measured slower) `GemvLinear`
hands the SwiGLU output to ``down_proj`` with its row amax gathered (`RowsWithAmax`), so ``down_proj``
quantizes it without a launch of its own (and ``o_proj`` the attention's output likewise).

Batch invariance by construction: with `GemvLinear`, a call of at most 16 rows (every decode step of
up to 16 pool slots, and the B=1 reference's steps) computes each row with a fixed reduction order
(the kernel pads to one 16-row tile; see `stage_ar.gemv`), so a row's bits do not depend on how many
other rows share the call. Calls above 16 rows go to cuBLAS, whose kernel choice depends on M; the
runner's ``pad_to_max_bucket`` gives those one shape.

`select_backend` is the one place the choice is made: ``"auto"`` is `GemvLinear` on CUDA with triton
and `TorchLinear` elsewhere (CPU tests run `GemvLinear` under Triton's interpreter explicitly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mammoth_core.settings import AR_LINEAR_BACKENDS, AR_WEIGHTS_DTYPES
from stage_ar import gemv as gemv_kernels
from stage_ar.fp8 import FP8_DTYPE, quantize_fp8_per_channel
from stage_ar.fp8_activations import (
    DELAYED_POINTS, DelayedOut, DelayedRows, QuantizedRows, RowsWithAmax, amax_buffers, delayed_state, quantize_rows,
)
from stage_ar.layers import rope_qkv, silu_and_mul, split_qkv

__all__ = [
    "BACKENDS", "GemvLinear", "LinearBackend", "MammothLinear", "PreNorm", "TORCH_LINEAR", "TorchLinear",
    "WEIGHTS_DTYPES", "norm_input", "quantize_fp8_", "select_backend", "set_linear_backend",
]

logger = logging.getLogger(__name__)

#: ``linear_backend`` setting values; ``weights_dtype`` values (the model dtype, or E4M3 with
#: per-output-channel scales). Defined with the settings.
BACKENDS, WEIGHTS_DTYPES = AR_LINEAR_BACKENDS, AR_WEIGHTS_DTYPES


@dataclasses.dataclass(frozen=True)
class PreNorm:
    """A pre-norm that follows an output projection (o_proj, down_proj), handed to the projection's
    backend so that it may fuse the two (`LinearBackend.project_norm_input`).

    Attributes:
        norm: the `mammoth_core.norms.RMSNorm` (the post-attention norm, or the next layer's input norm).
        residual: the residual stream the projection's output is added to, or None.
        ops: the norm's kernels (`stage_ar.layers.PointwiseOps`).
        consumer: the one projection that reads the normalised rows, or None (tokens split between experts).
        layer: the qkv projection of the layer whose state holds the delayed activation scales of the
            rows (`stage_ar.fp8_activations.delayed_state`: the projection that rolls it), or None (the
            forward's rows are not pool slots: a prefill, the reference path).
        after: ``"attention"`` (the post-attention norm, after o_proj) or ``"mlp"`` (the next layer's
            input norm, after down_proj): which of the layer's `stage_ar.fp8_activations.DELAYED_POINTS`
            the rows are.
    """

    norm: nn.Module
    residual: torch.Tensor | None
    ops: Any
    consumer: MammothLinear | None
    layer: MammothLinear | None = None
    after: str = "attention"

    def apply(self, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """`norm_input` of ``x`` (the projection's output) with this pre-norm."""
        return norm_input(self.norm, x, self.residual, self.ops, self.consumer)


class LinearBackend:
    """What every backend computes for the layers followed by a pointwise op: its own linear
    (``__call__``), then that op, unfused; and the normalised rows a layer reads (`norm_input`).
    Subclasses define ``__call__``."""

    def norm_input(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, ops: Any,
                   consumer: MammothLinear | None) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """The rows ``consumer`` (the one projection that reads them, or None) takes after the
        pre-norm ``norm`` (a `mammoth_core.norms.RMSNorm`), and the new residual stream: ``(norm(x +
        residual), x + residual)``, or ``(norm(x), x)`` where ``residual`` is None (the first layer).
        ``x``/``residual``: ``(..., hidden)``; ``ops``: the norm's kernels (`stage_ar.layers.PointwiseOps`).
        Here the norm module's own kernels; `GemvLinear` under W8A8 fuses the norm into the quantizer."""
        if residual is None:
            return norm(x, kernels=ops), x
        return norm(x, residual, kernels=ops)

    def swiglu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               weight_scale: torch.Tensor | None, act: Callable = silu_and_mul) -> torch.Tensor:
        """``act(linear(x))`` for a fused gate/up ``weight (2 I, K)``: ``(..., K)`` -> ``(..., I)`` in
        ``x.dtype``; ``act`` is `stage_ar.layers.silu_and_mul` or its compiled version."""
        return act(self(x, weight, bias, weight_scale))

    def input_amax(self, consumer: MammothLinear, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The `stage_ar.fp8_activations.amax_buffers` a producer fills for ``consumer``'s input of
        ``rows`` rows (then handed over as `RowsWithAmax`), or None: this backend quantizes nothing there."""
        return None

    def delayed_input(self, consumer: MammothLinear, rows: int, layer: MammothLinear | None) -> DelayedOut | None:
        """The `stage_ar.fp8_activations.DelayedOut` the attention's combine writes for ``consumer``
        (o_proj, ``rows`` rows) in ``layer``'s state, or None: this backend quantizes nothing there."""
        return None

    @contextlib.contextmanager
    def rows_computed(self, rows: int | None) -> Iterator[bool]:
        """Within it, the linear calls this backend runs may compute only the first ``rows`` rows of
        their output (the rest left unwritten; None: all): the idle slots' rows of a padded decode
        step (the runner's ``trim_gemv_rows``). Yields whether it does: here never."""
        yield False

    def mlp(self, x: torch.Tensor | QuantizedRows, gate_up: MammothLinear, down: MammothLinear,
            act: Callable = silu_and_mul, then: PreNorm | None = None) -> Any:
        """A SwiGLU MLP: ``down(act(gate_up(x)))`` for ``x (..., K)`` -> ``(..., down.out_features)`` in the
        activation dtype (`MammothLinear.forward_swiglu`, then ``down``; ``act``:
        `stage_ar.layers.silu_and_mul` or its compiled version). ``then``: the pre-norm after the MLP
        (the next layer's input norm): ``down`` through `project_norm_input`, whose pair is returned."""
        hidden = gate_up.forward_swiglu(x, act)
        return down(hidden) if then is None else down.backend.project_norm_input(down, hidden, then)

    def project_norm_input(self, linear: MammothLinear, x: Any, then: PreNorm) -> tuple[Any, torch.Tensor]:
        """An output projection and the pre-norm after it in one call, so that a backend may fuse them:
        ``then.apply(linear(x))`` (`norm_input`'s pair). Here the two in turn (``linear`` called as a
        module: its hooks, e.g. tensor parallelism's all-reduce, run)."""
        return then.apply(linear(x))

    def rope_qkv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 weight_scale: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 kv_heads: int, rope: Callable = rope_qkv,
                 rows_are_slots: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``rope(linear(x), cos, sin, heads, kv_heads)`` for a fused qkv ``weight ((heads + 2 kv_heads)
        d, K)``: ``x (B, T, K)``, ``cos``/``sin`` ``(B, T, d)`` -> q ``(B, T, heads, d)``, k, v ``(B, T,
        kv_heads, d)`` (`stage_ar.layers.rope_qkv` or its compiled version); ``rows_are_slots``:
        `MammothLinear.forward_rope_qkv`'s."""
        return rope(self(x, weight, bias, weight_scale), cos, sin, heads, kv_heads)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 weight_scale: torch.Tensor | None) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class TorchLinear(LinearBackend):
    """``F.linear``; FP8 weights widened per call, scaled per output row in float32."""

    name = "torch"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 weight_scale: torch.Tensor | None) -> torch.Tensor:
        """``x (..., K)`` -> ``(..., N)`` in ``x.dtype``; ``weight (N, K)`` in ``x.dtype`` or E4M3 with
        ``weight_scale (N,)`` float32; ``bias (N,)`` or None.

        Raises:
            TypeError: ``x`` is `QuantizedRows`, `RowsWithAmax` or `DelayedRows` (only `GemvLinear` makes
                and takes them)."""
        if isinstance(x, (QuantizedRows, RowsWithAmax, DelayedRows)):
            raise TypeError(f"TorchLinear takes activation rows, not {type(x).__name__} (GemvLinear's W8A8 input)")
        if weight_scale is None:
            return F.linear(x, weight, bias)
        y = F.linear(x, weight.to(x.dtype)).float() * weight_scale
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


TORCH_LINEAR = TorchLinear()


class GemvLinear(LinearBackend):
    """`stage_ar.gemv.gemv` for calls of at most ``max_rows`` rows, `TorchLinear` above.

    Args:
        config: a fixed `stage_ar.gemv.GemvConfig` (None: autotuned on CUDA, the interpreter's launch on CPU).
        fp8_compute: FP8 weights: `stage_ar.gemv.gemv`'s ``fp8_compute`` (None: its default,
            float16 products for 16-bit activations, saturating beyond +-65504).
        fuse_epilogues: which of `swiglu` and `rope_qkv` run in the GEMV's epilogue for the calls
            the kernel takes (one launch; the eager ops' roundings, `stage_ar.gemv`) instead of the
            given op after the linear, and (``"amax"``, W8A8 only) whether the launches before
            ``o_proj`` and ``down_proj`` gather their output rows' amax so those quantize in their
            GEMV's prologue (`stage_ar.fp8_activations.RowsWithAmax`) instead of a quantizer launch:
            names from `EPILOGUES`, True for all but `EXPERIMENTS`, False for none; `DEFAULT_EPILOGUES` by default
            (``rope`` and ``swiglu`` together took a bf16 batch-1 step on the H200 from 4.175 to
            4.086 ms; ``amax`` took a W8A8 step on the H100 from 3.44 to 4.96 ms, and from 3.27 to
            3.39 ms once the prologue multiplied by the row's inverse scale, 2026-12-06:
            docs/PERFORMANCE.md); ``"delayed"`` (W8A8 only, an opt-in experiment of issue 17, not yet
            measured on a GPU): delayed activation scales (`stage_ar.fp8_activations.DelayedOut`): the
            attention's combine, o_proj (with the post-attention norm's weight), the SwiGLU GEMV and
            down_proj (with the next layer's input norm's weight) write their consumer's codes, so no
            quantizer launch stands between them (`delayed_input`, `project_norm_input`, `mlp`); each
            layer's qkv GEMV rolls the layer's state; only in decode steps whose rows are pool slots.

    Raises:
        ValueError: an unknown epilogue name.
    """

    #: The epilogues ``fuse_epilogues`` may name.
    EPILOGUES = ("rope", "swiglu", "amax", "delayed")
    #: Those only fused where named (True leaves them out): experiments not yet measured to be served.
    EXPERIMENTS = ("delayed",)
    #: Those fused unless a caller says otherwise (``amax`` measured slower: see ``fuse_epilogues``).
    DEFAULT_EPILOGUES = ("rope", "swiglu")

    name = "gemv"
    max_rows = gemv_kernels.MAX_ROWS

    def __init__(self, config: gemv_kernels.GemvConfig | None = None, fp8_compute: str | None = None,
                 fuse_epilogues: bool | Iterable[str] = DEFAULT_EPILOGUES) -> None:
        self.config, self.fp8_compute = config, fp8_compute
        names = (tuple(e for e in self.EPILOGUES if e not in self.EXPERIMENTS) if fuse_epilogues is True
                 else () if fuse_epilogues is False else tuple(fuse_epilogues))
        if unknown := set(names) - set(self.EPILOGUES):
            raise ValueError(f"fuse_epilogues takes {self.EPILOGUES}, got {sorted(unknown)}")
        #: the epilogues fused (empty: none)
        self.fuse_epilogues = frozenset(names)
        #: rows the kernel computes per call (`rows_computed`; None: all)
        self.rows: int | None = None

    @contextlib.contextmanager
    def rows_computed(self, rows):
        """`LinearBackend.rows_computed`: the GEMV launches compute the first ``rows`` rows
        (`stage_ar.gemv.gemv`'s ``rows``, which refuses fewer than 1; a computed row's bits do not
        change); yields True. Calls above ``max_rows`` rows (torch) compute every row."""
        saved, self.rows = self.rows, rows
        try:
            yield True
        finally:
            self.rows = saved

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 weight_scale: torch.Tensor | None) -> torch.Tensor:
        """As `TorchLinear.__call__`; the kernel's numerics are `stage_ar.gemv_reference.gemv_reference`."""
        flat = self._kernel_rows(x, weight)
        if flat is None:
            return TORCH_LINEAR(x, weight, bias, weight_scale)
        out = self._gemv(flat, weight, bias, weight_scale)
        return out.view(*x.shape[:-1], out.shape[-1])

    def swiglu(self, x, weight, bias, weight_scale, act=silu_and_mul):
        """`LinearBackend.swiglu`; with ``"swiglu"`` fused one SwiGLU-epilogue launch where the kernel
        takes the call (``x`` of at most ``max_rows`` rows)."""
        flat = self._kernel_rows(x, weight) if "swiglu" in self.fuse_epilogues else None
        if flat is None:
            return super().swiglu(x, weight, bias, weight_scale, act)
        out = self._gemv(flat, weight, bias, weight_scale, swiglu=True)
        return out.view(*x.shape[:-1], out.shape[-1])

    def rope_qkv(self, x, weight, bias, weight_scale, cos, sin, heads, kv_heads, rope=rope_qkv,
                 rows_are_slots=False):
        """`LinearBackend.rope_qkv`; with ``"rope"`` fused one RoPE-epilogue launch (q and k heads
        rotated, v passed through) where the kernel takes the call; q, k, v are views of its output.
        With ``"delayed"`` in a decode step whose rows are slots, the launch also rolls the layer's
        delayed-scale state."""
        flat = self._kernel_rows(x, weight) if "rope" in self.fuse_epilogues else None
        if flat is None:
            return super().rope_qkv(x, weight, bias, weight_scale, cos, sin, heads, kv_heads, rope, rows_are_slots)
        d = cos.shape[-1]
        rows = flat.shape[0]
        roll = delayed_state(weight) if rows_are_slots and self._delayed(weight_scale) else None
        out = self._gemv(flat, weight, bias, weight_scale, cos=cos.reshape(rows, d).contiguous(),
                         sin=sin.reshape(rows, d).contiguous(), rope_columns=(heads + kv_heads) * d, roll=roll)
        return split_qkv(out.view(*x.shape[:-1], out.shape[-1]), heads, kv_heads)

    def input_amax(self, consumer, rows):
        """`LinearBackend.input_amax`: ``consumer``'s buffers under W8A8 with ``"amax"`` fused, for an
        E4M3 ``consumer`` and calls the kernel takes (at most ``max_rows`` rows), else None."""
        if ("amax" not in self.fuse_epilogues or self.fp8_compute != "fp8" or not consumer.is_fp8
                or not consumer.weight.is_contiguous() or not 1 <= rows <= self.max_rows):
            return None
        return amax_buffers(consumer.weight)

    def _delayed(self, weight_scale) -> bool:
        """Whether W8A8 launches with E4M3 weights run with delayed activation scales (``"delayed"``)."""
        return "delayed" in self.fuse_epilogues and self.fp8_compute == "fp8" and weight_scale is not None

    def _reads_delayed(self, consumer, rows) -> bool:
        """Whether ``consumer`` (E4M3, this backend, a contiguous weight) reads ``rows`` rows quantized
        with delayed scales (`_delayed`): calls the kernel takes."""
        return (consumer is not None and consumer.is_fp8 and consumer.backend is self
                and consumer.weight.is_contiguous() and self._delayed(consumer.weight_scale)
                and 1 <= rows <= self.max_rows)

    def _writes_delayed(self, linear, consumer, rows) -> bool:
        """Whether ``linear`` (E4M3, this backend, no hooks: tensor parallelism's all-reduce must run on
        its output first) writes ``consumer``'s input with delayed scales (`_reads_delayed`)."""
        return (self._reads_delayed(consumer, rows) and linear.is_fp8 and linear.backend is self
                and not linear._forward_hooks and not linear._forward_pre_hooks)

    def delayed_input(self, consumer, rows, layer):
        """`LinearBackend.delayed_input`: with ``"delayed"``, for a ``consumer`` that reads such rows
        (`_reads_delayed`), the attention output point of ``layer``'s state."""
        if layer is None or not self._reads_delayed(consumer, rows):
            return None
        return DelayedOut(delayed_state(layer.weight), DELAYED_POINTS.index("o_input"))

    def project_norm_input(self, linear, x, then):
        """`LinearBackend.project_norm_input`; with ``"delayed"`` (`_writes_delayed`) and a residual, one
        launch: ``linear``'s GEMV adds the residual in its epilogue (the new residual stream) and writes
        the consumer's input as `DelayedRows` with the norm's weight in the codes (its inverse RMS
        applied by the consumer's GEMV)."""
        flat = self._kernel_rows(x, linear.weight) if then.residual is not None else None
        rows = flat.shape[0] if flat is not None else 0
        if (flat is None or then.layer is None or not self._writes_delayed(linear, then.consumer, rows)
                or then.residual.numel() != rows * linear.out_features):
            return super().project_norm_input(linear, x, then)
        point = DELAYED_POINTS.index("gate_up_input" if then.after == "attention" else "qkv_input")
        summed, codes = self._gemv(flat, linear.weight, linear.bias, linear.weight_scale,
                                   residual=then.residual.reshape(rows, -1).contiguous(),
                                   delayed_out=DelayedOut(delayed_state(then.layer.weight), point, then.norm.weight,
                                                          then.norm.variance_epsilon))
        return dataclasses.replace(codes, view_shape=then.residual.shape), summed.view(then.residual.shape)

    def mlp(self, x, gate_up, down, act=silu_and_mul, then=None):
        """`LinearBackend.mlp`; on `DelayedRows` with ``"delayed"`` and ``"swiglu"`` fused, the SwiGLU GEMV
        writes ``down``'s input with delayed scales in the same layer's state (then ``down`` as
        `project_norm_input` or a module call); otherwise as below."""
        if ("swiglu" in self.fuse_epilogues and isinstance(x, DelayedRows)
                and self._writes_delayed(gate_up, down, x.codes.shape[0])):
            _, mid = self._gemv(self._kernel_rows(x, gate_up.weight), gate_up.weight, gate_up.bias, gate_up.weight_scale,
                                swiglu=True, delayed_out=DelayedOut(x.state, DELAYED_POINTS.index("down_input")))
            mid = dataclasses.replace(mid, view_shape=torch.Size((*x.shape[:-1], mid.codes.shape[1])))
            return down(mid) if then is None else self.project_norm_input(down, mid, then)
        return self._mlp(x, gate_up, down, act, then)

    def _mlp(self, x, gate_up, down, act=silu_and_mul, then=None):
        """`mlp` otherwise: under W8A8 with ``"swiglu"`` and ``"amax"`` fused, for E4M3 ``gate_up`` and ``down`` and
        calls the kernel takes, two launches: the SwiGLU GEMV also gathers each output row's amax
        (``amax_out``) and ``down`` quantizes those rows in its GEMV's prologue
        (`stage_ar.fp8_activations.RowsWithAmax`: `quantize_rows`' bits, without its launch). ``down``
        is called as a module (its hooks, e.g. tensor parallelism's all-reduce, run)."""
        rows = x.codes.shape[0] if isinstance(x, QuantizedRows) else x.numel() // max(1, x.shape[-1])
        fusable = "swiglu" in self.fuse_epilogues and gate_up.is_fp8 and down.backend is self
        buffers = self.input_amax(down, rows) if fusable else None
        flat = self._kernel_rows(x, gate_up.weight) if buffers is not None else None
        if flat is None:
            return super().mlp(x, gate_up, down, act, then)
        hidden = self._gemv(flat, gate_up.weight, gate_up.bias, gate_up.weight_scale, swiglu=True, amax_out=buffers[0])
        rows = RowsWithAmax(hidden.view(*x.shape[:-1], hidden.shape[-1]), *buffers)
        return down(rows) if then is None else self.project_norm_input(down, rows, then)

    def norm_input(self, norm, x, residual, ops, consumer):
        """`LinearBackend.norm_input`; under W8A8 (``fp8_compute="fp8"``), for a ``consumer`` with E4M3
        weights and calls the kernel takes (at most ``max_rows`` rows), one launch instead of two:
        `stage_ar.fp8_activations.quantize_rows` adds the residual, normalises (`stage_ar.row_norm`'s
        summation order, not the norm module's kernels': W8A8's own numerics) and quantizes, and the
        rows come back as `QuantizedRows` for ``consumer``'s GEMV."""
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if (self.fp8_compute != "fp8" or consumer is None or not consumer.is_fp8
                or not consumer.weight.is_contiguous() or not 1 <= rows <= self.max_rows):
            return super().norm_input(norm, x, residual, ops, consumer)
        flat = x.reshape(rows, k).contiguous()
        if residual is None:
            codes, scales = quantize_rows(flat, norm.weight, norm.variance_epsilon)
            summed = x
        else:
            codes, scales, summed = quantize_rows(flat, norm.weight, norm.variance_epsilon,
                                                  residual=residual.reshape(rows, k).contiguous())
            summed = summed.view(x.shape)
        return QuantizedRows(codes, scales, x.dtype, x.shape), summed

    def _kernel_rows(self, x, weight):
        """``x`` as ``(rows, K)`` with contiguous rows when the kernel takes the call, else None.

        (`QuantizedRows` and `RowsWithAmax` flattened to 2-D rows.)

        Raises:
            ValueError: `QuantizedRows` or `RowsWithAmax` the kernel cannot take (more than
                ``max_rows`` rows, or a non-contiguous weight): nothing else can multiply them."""
        if isinstance(x, (QuantizedRows, DelayedRows)):
            if not x.codes.shape[0] <= self.max_rows or not weight.is_contiguous():
                raise ValueError(f"{type(x).__name__} of {x.codes.shape[0]} rows for a weight of shape "
                                 f"{tuple(weight.shape)}: the GEMV takes at most {self.max_rows} rows, contiguous weights")
            if isinstance(x, DelayedRows):
                return dataclasses.replace(x, view_shape=None)
            return QuantizedRows(x.codes, x.scales, x.dtype, x.codes.shape)
        if isinstance(x, RowsWithAmax):
            values = x.values.reshape(-1, x.values.shape[-1])
            if not values.shape[0] <= self.max_rows or not weight.is_contiguous() or values.stride(1) != 1:
                raise ValueError(f"RowsWithAmax of {values.shape[0]} rows for a weight of shape {tuple(weight.shape)}: "
                                 f"the GEMV takes at most {self.max_rows} rows, contiguous")
            return RowsWithAmax(values, x.amax, x.counter)
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not 1 <= rows <= self.max_rows or not weight.is_contiguous():
            return None
        flat = x.reshape(rows, k)
        return flat if flat.stride(1) == 1 else flat.contiguous()

    def _gemv(self, flat, weight, bias, weight_scale, **epilogue) -> torch.Tensor:
        return gemv_kernels.gemv(flat, weight, weight_scale=weight_scale, bias=bias, config=self.config,
                                 fp8_compute=self.fp8_compute if weight_scale is not None else None, rows=self.rows,
                                 **epilogue)


def norm_input(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, ops: Any,
               consumer: MammothLinear | None) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """A decoder layer's pre-norm: ``consumer``'s backend's `LinearBackend.norm_input` (the module's
    own kernels where ``consumer`` is None: tokens split between two experts)."""
    backend = consumer.backend if consumer is not None else TORCH_LINEAR
    return backend.norm_input(norm, x, residual, ops, consumer)


def select_backend(name: str, device: torch.device | str, *,
                   fuse_epilogues: bool | Iterable[str] = GemvLinear.DEFAULT_EPILOGUES,
                   fp8_compute: str | None = None) -> TorchLinear | GemvLinear:
    """The linear backend for ``name`` (`BACKENDS`) on ``device``.

    ``"auto"``: `GemvLinear` on CUDA when triton is importable, else `TorchLinear`. ``"gemv"`` where
    the kernel cannot run (no triton; CPU without the interpreter) falls back to `TorchLinear` with
    a logged warning. ``fuse_epilogues``, ``fp8_compute``: `GemvLinear`'s (ignored by `TorchLinear`,
    which multiplies FP8 weights with activations in their own dtype).

    Raises:
        ValueError: ``name`` is not one of `BACKENDS`.
    """
    if name not in BACKENDS:
        raise ValueError(f"linear backend must be one of {BACKENDS}, got {name!r}")
    device = torch.device(device)
    usable = gemv_kernels.available(device)
    if name == "auto":
        name = "gemv" if usable and device.type == "cuda" else "torch"
    if name == "gemv" and not usable:
        logger.warning("GEMV kernels cannot run on %s (needs CUDA and triton); using torch matmul", device)
        name = "torch"
    return GemvLinear(fp8_compute=fp8_compute, fuse_epilogues=fuse_epilogues) if name == "gemv" else TORCH_LINEAR


class MammothLinear(nn.Linear):
    """``nn.Linear`` whose product goes through a pluggable backend (`TorchLinear` by default).

    Attributes:
        backend: a `LinearBackend`: ``backend(x, weight, bias, weight_scale)`` computes the product,
            its ``swiglu`` / ``rope_qkv`` the product followed by that op.
        weight_scale: None, or after `quantize_fp8` the ``(out_features,)`` float32 row scales
            (a buffer: in the state dict as ``<name>.weight_scale``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.backend = TORCH_LINEAR
        self.register_buffer("weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., in_features)`` -> ``(..., out_features)`` in ``x.dtype``."""
        return self.backend(x, self.weight, self.bias, self.weight_scale)

    def forward_swiglu(self, x: torch.Tensor, act: Callable = silu_and_mul) -> torch.Tensor:
        """SwiGLU of this fused gate/up layer's output: ``x (..., in_features)`` -> ``(..., out_features
        / 2)`` in ``x.dtype``, i.e. ``act(self(x))`` (`LinearBackend.swiglu`; ``act``:
        `stage_ar.layers.silu_and_mul` or its compiled version). Calls the backend directly (no
        ``nn.Module`` hooks)."""
        return self.backend.swiglu(x, self.weight, self.bias, self.weight_scale, act)

    def forward_rope_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                         rope: Callable = rope_qkv, rows_are_slots: bool = False,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of this fused qkv layer, q and k rotated: ``rope(self(x), cos, sin, heads,
        kv_heads)`` (`LinearBackend.rope_qkv`; ``x (B, T, in_features)``, ``cos``/``sin`` ``(B, T, d)``
        in ``x.dtype``; ``rope``: `stage_ar.layers.rope_qkv` or its compiled version). Calls the
        backend directly (no ``nn.Module`` hooks). ``rows_are_slots``: the forward is a decode step
        whose rows are pool slots (the delayed activation scales' state rows may advance)."""
        return self.backend.rope_qkv(x, self.weight, self.bias, self.weight_scale, cos, sin, heads, kv_heads, rope,
                                     rows_are_slots)

    def forward_rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Only output rows ``[start, end)`` (e.g. the head's visual codes): ``(..., end - start)``."""
        bias = None if self.bias is None else self.bias[start:end]
        scale = None if self.weight_scale is None else self.weight_scale[start:end]
        return self.backend(x, self.weight[start:end], bias, scale)

    @property
    def is_fp8(self) -> bool:
        """Whether the weight holds E4M3 codes (with ``weight_scale``)."""
        return self.weight.dtype == FP8_DTYPE

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Replace the weight by its E4M3 codes and ``weight_scale`` (`stage_ar.fp8`), in place on
        the weight's device; the model-dtype weight is released. The bias keeps its dtype. No-op when
        already FP8."""
        if self.is_fp8:
            return
        codes, scale = quantize_fp8_per_channel(self.weight)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale = scale

    @torch.no_grad()
    def hold_fp8(self) -> None:
        """Make the weight an uninitialised E4M3 ``(out, in)`` tensor and ``weight_scale`` an
        uninitialised float32 ``(out,)`` one, on the weight's device (``meta`` too): the storage a
        checkpoint holding this layer in FP8 (`stage_ar.fp8.stores_fp8`) is loaded into. No-op when
        already FP8."""
        if self.is_fp8:
            return
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.weight_scale = torch.empty(self.weight.shape[0], dtype=torch.float32, device=device)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", weights=fp8_e4m3 per-row scale" if self.is_fp8 else "")


def set_linear_backend(model: nn.Module, backend: TorchLinear | GemvLinear) -> None:
    """Route every `MammothLinear` of ``model`` through ``backend``; ``model.linear_backend`` records it."""
    model.linear_backend = backend
    for module in model.modules():
        if isinstance(module, MammothLinear):
            module.backend = backend


def quantize_fp8_(linears: Iterable[MammothLinear]) -> int:
    """`MammothLinear.quantize_fp8` on each of ``linears`` (one at a time, so the peak is one
    layer's float32 temporary); returns the model-dtype bytes released minus the FP8 bytes kept."""
    saved = 0
    for linear in linears:
        before = linear.weight.numel() * linear.weight.element_size()
        linear.quantize_fp8()
        saved += before - linear.weight.numel() - linear.weight_scale.numel() * 4
    return saved
