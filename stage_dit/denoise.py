"""One denoising step over any number of requests of one resolution: the DiT's only CFG loop body.

Each request is a `DenoiseState` (its latents, its own flow-matching scheduler, its step index and
optional step cache); `denoise_step` runs the transformer over every CFG branch of every state in
the group (each condition right-padded to the longest of its forward and masked; the conditional
and the unconditional rows are one forward, or two when their caption lengths differ:
`branch_groups`), then each request's guidance and Euler update. Requests of different `num_inference_steps`,
`cfg_range` phases, seeds and guidance scales share a forward; a request joins or leaves a group
between steps. The step cache runs only over the plain model (not the wrappers of
`stage_dit.parallel`, which run every layer). Per request the result does not depend on the group: on the CPU (float32) it is
bit-identical to the request alone (`modules.ROW_QUANTUM`; tested in
`tests/unit/test_dit_batching.py`); on CUDA cuBLAS picks kernels by shape, so a batched request
differs from alone by rounding, bounded in `tests/unit/test_dit_batching.py::test_cuda_batched_within_bf16_bound`.

The guidance rule: at step i of N, `v = v_cond`; if `text_guidance_scale > 1` and
`cfg_range[0] <= i/N <= cfg_range[1]`, `v = v_uncond + s (v_cond - v_uncond)`. The unconditional
branch is the negative prompt's raw AR rows or, without one, an empty condition (zero rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from stage_dit.graphs import GraphCache
from stage_dit.modules import pad_rows, round_up
from stage_dit.step_cache import FirstBlockCache, StepCacheConfig
from stage_dit.transformer_mammoth import MammothTransformerBlock


class ConditionTooLongError(ValueError):
    """A condition with more rows than the DiT's caption rotary positions: the request's own fault
    (its prompt or negative prompt is too long for this model), which no retry fixes
    (`stage_dit.pipeline.MammothDiTPipeline.check_condition` raises it, the server answers
    INVALID_ARGUMENT with reason INVALID_REQUEST naming ``field``, the gateway a 400 with that param).

    Attributes:
        field: the request field to shorten, ``"prompt"`` or ``"negative_prompt"``.
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ImageRequest:
    """What the DiT denoises for one image (conditions already prepared).

    Attributes:
        condition: `(cond_len, llm_hidden)` from `MammothDiTPipeline.prepare_conditions`.
        negative: `(neg_len, llm_hidden)` raw AR rows of a negative prompt, or None.
        width, height: pixels, positive multiples of the pipeline's `size_multiple` (16).
        num_inference_steps: N >= 1.
        text_guidance_scale: s (finite); <= 1 disables guidance.
        cfg_range: `(start, end)`, `0 <= start <= end <= 1`.
        seed: initial noise seed (CPU generator, device independent).
        cache: opt-in step cache (None or threshold 0: off).
        request_id: for logs and errors.
    """

    condition: torch.Tensor
    negative: torch.Tensor | None
    width: int
    height: int
    num_inference_steps: int
    text_guidance_scale: float
    cfg_range: tuple[float, float] = (0.0, 1.0)
    seed: int = 0
    cache: StepCacheConfig | None = None
    request_id: str = ""


class DenoiseState:
    """One request's denoising state.

    Args:
        pipeline: the `MammothDiTPipeline` (condition checks, noise, a fresh scheduler).
        request: the `ImageRequest`.
        latents: initial float32 latents `(1, C, h, w)`; None = `pipeline.prepare_latents` from the seed.

    Attributes:
        latents: float32 `(1, C, h, w)` after `step` steps.
        step: steps done; `total`: N.
        cache: `FirstBlockCache` or None.

    Raises:
        ValueError: bad shapes, sizes or parameters (before any step runs).
    """

    def __init__(self, pipeline, request: ImageRequest, latents: torch.Tensor | None = None) -> None:
        if not math.isfinite(float(request.text_guidance_scale)):
            raise ValueError(f"text_guidance_scale must be finite, got {request.text_guidance_scale}")
        start, end = (float(x) for x in request.cfg_range) if len(request.cfg_range) == 2 else (1.0, 0.0)
        if not 0.0 <= start <= end <= 1.0:
            raise ValueError(f"cfg_range must satisfy 0 <= start <= end <= 1, got {tuple(request.cfg_range)}")
        self.request = request
        self.condition = pipeline.check_condition("condition", request.condition)
        negative = request.negative
        self.unconditional = (pipeline.check_condition("negative", negative) if negative is not None
                              else self.condition.new_zeros(0, self.condition.shape[1]))
        if latents is None:
            latents = pipeline.prepare_latents(width=request.width, height=request.height, seed=request.seed)
        self.latents = latents.to(pipeline.device, torch.float32)
        self.scheduler = pipeline.new_scheduler()
        self.timesteps = self.scheduler.set_timesteps(  # on the latents' device: no host sync per step
            request.num_inference_steps, num_tokens=self.latents.shape[-2] * self.latents.shape[-1],
            device=self.latents.device)
        self.total = len(self.timesteps)
        self.step = 0
        cache = request.cache
        self.cache = FirstBlockCache(cache) if cache is not None and cache.enabled else None

    @property
    def done(self) -> bool:
        return self.step >= self.total

    @property
    def resolution(self) -> tuple[int, int]:
        """Latent `(h, w)`: requests of one resolution share a forward."""
        return int(self.latents.shape[-2]), int(self.latents.shape[-1])

    def guided(self) -> bool:
        """Whether the current step applies guidance (the rule in the module docstring)."""
        lo, hi = self.request.cfg_range
        return self.request.text_guidance_scale > 1.0 and lo <= self.step / self.total <= hi

    def branches(self) -> list[torch.Tensor]:
        """This step's conditions: `[condition]` or `[condition, unconditional]`."""
        return [self.condition, self.unconditional] if self.guided() else [self.condition]

    def advance(self, velocities: list[torch.Tensor]) -> None:
        """Guidance and the Euler update from this step's float32 velocities (one per branch)."""
        if len(velocities) == 2:
            v_cond, v_uncond = velocities
            v = v_uncond + self.request.text_guidance_scale * (v_cond - v_uncond)
        else:
            (v,) = velocities
        self.latents = self.scheduler.step(v, self.step, self.latents)
        self.step += 1


def pad_conditions(conditions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad `(len_i, hidden)` conditions into `(n, max_len, hidden)` and a bool mask."""
    first = conditions[0]
    max_len = max(c.shape[0] for c in conditions)
    text = first.new_zeros(len(conditions), max_len, first.shape[1])
    mask = torch.zeros(len(conditions), max_len, dtype=torch.bool, device=first.device)
    for i, c in enumerate(conditions):
        text[i, : c.shape[0]] = c
        mask[i, : c.shape[0]] = True
    return text, mask


@torch.inference_mode()
def denoise_step(transformer, states: list[DenoiseState], graphs: GraphCache | None = None) -> None:
    """Advance every state (all of one resolution, none done) by one step: one transformer pass over
    every CFG row (`_velocities`: the plain model refines each request's image once and runs the
    joint layers once per `branch_groups` group).

    With ``graphs`` (CUDA, the plain model, no step cache in the group) the pass is replayed from
    a CUDA graph of its shape (`stage_dit.graphs`; the same values as eager).

    Raises:
        ValueError: states of different resolutions; whatever the transformer raises (then no
            state has advanced).
    """
    if len({s.resolution for s in states}) != 1:
        raise ValueError("denoise_step needs states of one resolution")
    # branch-major rows (every conditional branch, then every unconditional one): rows of one key
    # length sit next to each other, so attention runs over slices (`modules.masked_attention`)
    branches = [state.branches() for state in states]
    owners: list[tuple[DenoiseState, int]] = []
    conditions: list[torch.Tensor] = []
    for branch in range(max(len(b) for b in branches)):
        for state, conds in zip(states, branches):
            if branch < len(conds):
                owners.append((state, branch))
                conditions.append(conds[branch])
    rows = _velocities(transformer, states, owners, conditions, graphs)
    for state in states:
        state.advance([rows[i] for i, (s, _) in enumerate(owners) if s is state])


def branch_groups(owners: list[tuple[DenoiseState, int]], conditions: list[torch.Tensor]) -> list[list[int]]:
    """Which of a step's branch-major rows run through the joint layers together (lists of indices
    into ``owners``, each list in order).

    One pass pads every condition to the longest, so an unconditional branch (an empty or short
    negative prompt) would run the joint layers over the conditional branch's caption length in
    padding rows (at 512² with 128 caption rows: 11 % of its rows, 5.6 % of a CFG step's GEMM rows,
    and its attention over 1,152 instead of 1,024 queries). So the conditional and the unconditional
    rows are two passes when their padded caption lengths differ (`modules.round_up`), one otherwise.
    """
    by_branch: dict[int, list[int]] = {}
    for i, (_, branch) in enumerate(owners):
        by_branch.setdefault(branch, []).append(i)
    longest = {b: round_up(max(conditions[i].shape[0] for i in idx)) for b, idx in by_branch.items()}
    if len(set(longest.values())) == 1:
        return [list(range(len(owners)))]
    return [by_branch[b] for b in sorted(by_branch)]


def _velocities(transformer, states: list[DenoiseState], owners: list[tuple[DenoiseState, int]],
                conditions: list[torch.Tensor], graphs: GraphCache | None) -> list[torch.Tensor]:
    """The float32 velocity `(1, C, h, w)` of every row of ``owners`` (branch-major rows of ``states``).

    The plain model runs `refine_image` once per request (its CFG branches share the noise refiner:
    `MammothTransformer2DModel.refine_image`), then the joint layers once per `branch_groups` group
    (one group over every row when a request in it has a step cache: its decision reads both of its
    branches), all of it one CUDA graph replay where it can (no step cache). A parallel wrapper runs
    its one forward over every row."""
    if not hasattr(transformer, "embed"):  # a wrapper with the plain forward only (CFG-parallel)
        return _rows(transformer(*_inputs(owners), *pad_conditions(conditions)).float())
    if not _plain_layers(transformer):  # layers sharded over ranks (Ulysses): every row refines its own image
        batch = transformer.embed(*_inputs(owners), *pad_conditions(conditions),
                                  caption_lengths=[c.shape[0] for c in conditions])
        return _rows(transformer.unpatchify(transformer.run_layers(batch, 0, len(transformer.layers))).float())

    cached = any(s.cache is not None for s in states)
    groups = [list(range(len(owners)))] if cached else branch_groups(owners, conditions)
    state_of = {id(state): k for k, state in enumerate(states)}
    index = [[state_of[id(owners[i][0])] for i in group] for group in groups]
    lengths = [[conditions[i].shape[0] for i in group] for group in groups]
    padded = [pad_conditions([conditions[i] for i in group]) for group in groups]
    latents, t = _inputs([(state, 0) for state in states])

    def forward(latents, t, *texts_and_masks):
        pairs = list(zip(texts_and_masks[0::2], texts_and_masks[1::2]))
        x, temb = transformer.refine_image(latents, t)  # one row per state
        out = []
        for (text, mask), idx, lens in zip(pairs, index, lengths):
            refined = (_take(x, idx), pad_rows(_take(temb, idx), round_up(len(idx))))
            batch = transformer.embed(_take(latents, idx), _take(t, idx), text, mask, caption_lengths=lens,
                                      refined=refined)
            if cached:
                batch = _cached_layers(transformer, batch, owners)
            else:
                batch = transformer.run_layers(batch, 0, len(transformer.layers))
            out.append(transformer.unpatchify(batch).float())
        return torch.cat(out)

    inputs = (latents, t, *[x for pair in padded for x in pair])
    if graphs is not None and latents.is_cuda and not cached:
        velocity = graphs.run((tuple(map(tuple, lengths)), tuple(map(tuple, index))), inputs, forward)
    else:
        velocity = forward(*inputs)
    rows: list[torch.Tensor] = [None] * len(owners)  # type: ignore[list-item]
    order = [i for group in groups for i in group]
    for k, i in enumerate(order):
        rows[i] = velocity[k : k + 1]
    return rows


def _inputs(owners: list[tuple[DenoiseState, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The latents `(len(owners), C, h, w)` and float32 timesteps `(len(owners),)` of ``owners``' rows."""
    latents = torch.cat([s.latents for s, _ in owners])
    return latents, torch.stack([s.timesteps[s.step] for s, _ in owners]).to(latents.device, torch.float32)


def _rows(velocity: torch.Tensor) -> list[torch.Tensor]:
    return [velocity[i : i + 1] for i in range(velocity.shape[0])]


def _take(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """Rows ``index`` (host ints) of ``x``: a view when they are consecutive, else a concatenation
    of slices (no index tensor: nothing copied from the host, so a CUDA graph can capture it)."""
    if index == list(range(index[0], index[0] + len(index))):
        return x[index[0] : index[0] + len(index)]
    return torch.cat([x[i : i + 1] for i in index])


def _plain_layers(transformer) -> bool:
    """Whether the joint layers may run in two parts (not when sharded over ranks: Ulysses'
    first layer splits the sequence and only the last gathers it)."""
    return all(isinstance(block, MammothTransformerBlock) for block in transformer.layers)


def _cached_layers(transformer, batch, owners: list[tuple[DenoiseState, int]]):
    """The joint layers with the first-block cache: every row runs layer 0; the rows of requests
    whose cache allows it skip the rest (see `stage_dit.step_cache`)."""
    n_layers = len(transformer.layers)
    first = transformer.run_layers(batch, 0, 1)
    residual = {i: first.joint[i, : n] - batch.joint[i, : n] for i, n in enumerate(first.real_rows)}
    skip: set[int] = set()
    for state in {s for s, _ in owners}:
        rows = {b: i for i, (s, b) in enumerate(owners) if s is state}
        if state.cache is not None and state.cache.should_skip(state.step, {b: residual[i] for b, i in rows.items()}):
            skip.update(rows.values())
            state.cache.skipped += 1
    run = [i for i in range(len(owners)) if i not in skip]
    joint = first.joint.clone()
    if run:
        done = transformer.run_layers(first if len(run) == len(owners) else first.select(run), 1, n_layers)
        joint[run] = done.joint
    for i, (state, branch) in enumerate(owners):
        n = first.real_rows[i]
        if i in skip:
            joint[i, :n] = first.joint[i, :n] + state.cache.rest[branch]
        elif state.cache is not None:
            state.cache.update({branch: residual[i]}, {branch: joint[i, :n] - first.joint[i, :n]})
    return replace(first, joint=joint)
