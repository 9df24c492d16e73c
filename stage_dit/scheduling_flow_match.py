"""Flow-matching Euler scheduler of MammothModa2 (upstream `FlowMatchEulerDiscreteScheduler`).

Time runs from t = 0 (pure noise) to t = 1 (data); the model predicts the velocity `v = dx/dt` and
one Euler step is `x <- x + (t_next - t) * v`. Upstream: `mammothmoda2_dit/schedulers.py`, commit
2317bbce.
"""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config


class FlowMatchEulerScheduler(ConfigMixin):
    """Euler sampler over a resolution-shifted uniform grid.

    Schedule for `N` steps (`set_timesteps`): `t = linspace(0, 1, N + 1)[:-1]` in float32, then with
    dynamic shift `t <- t / (m - m t + t)`, `m = sqrt(num_tokens) / shift_base_len` (upstream: 40, so
    m = 1 for a 40x40 latent, i.e. 320x320 pixels, and m = 3.2 at 1024x1024); without dynamic shift
    the static `shift` is used as `m`. The step after the last goes to t = 1.

    Args:
        num_train_timesteps: recorded for compatibility; the grid is continuous.
        dynamic_time_shift: derive `m` from the number of latent pixels.
        shift_base_len: side length (in latent pixels) at which the dynamic shift is 1.
        shift: static `m` (only without dynamic shift).

    Raises:
        ValueError: on a non-positive `num_train_timesteps`, `shift_base_len` or `shift`, or when a
            static `shift` other than 1 is combined with `dynamic_time_shift=True`.
    """

    config_name = "scheduler_config.json"

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        dynamic_time_shift: bool = True,
        shift_base_len: float = 40.0,
        shift: float = 1.0,
    ) -> None:
        if num_train_timesteps <= 0:
            raise ValueError(f"num_train_timesteps must be positive, got {num_train_timesteps}")
        if shift_base_len <= 0 or shift <= 0:
            raise ValueError(f"shift_base_len ({shift_base_len}) and shift ({shift}) must be positive")
        if dynamic_time_shift and shift != 1.0:
            raise ValueError("a static shift cannot be combined with dynamic_time_shift=True")
        self.timesteps: torch.Tensor = torch.empty(0)
        self.timesteps_with_end: torch.Tensor = torch.empty(0)
        self.num_inference_steps: int | None = None

    def set_timesteps(
        self, num_inference_steps: int, num_tokens: int | None = None, device: str | torch.device | None = None
    ) -> torch.Tensor:
        """Build the schedule.

        Args:
            num_inference_steps: number of Euler steps N >= 1.
            num_tokens: latent pixels `latent_h * latent_w` (not DiT patches); required with dynamic shift.
            device: where the timesteps live.

        Returns:
            `timesteps`, float32 `(N,)`; `timesteps_with_end` `(N + 1,)` appends 1.0.

        Raises:
            ValueError: if N < 1, `num_tokens` < 1, or `num_tokens` is missing with dynamic shift.
        """
        if int(num_inference_steps) != num_inference_steps or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a positive integer, got {num_inference_steps}")
        if self.config.dynamic_time_shift:
            if num_tokens is None:
                raise ValueError("num_tokens (latent pixels) is required with dynamic_time_shift=True")
            if num_tokens < 1:
                raise ValueError(f"num_tokens must be positive, got {num_tokens}")
            m = math.sqrt(num_tokens) / self.config.shift_base_len
        else:
            m = float(self.config.shift)
        n = int(num_inference_steps)
        t = torch.linspace(0, 1, n + 1, dtype=torch.float32)[:-1]
        if self.config.dynamic_time_shift or m != 1.0:
            t = t / (m - m * t + t)
        self.num_inference_steps = n
        self.timesteps = t.to(device)
        self.timesteps_with_end = torch.cat([t, torch.ones(1, dtype=torch.float32)]).to(device)
        return self.timesteps

    def step(self, model_output: torch.Tensor, step_index: int, sample: torch.Tensor) -> torch.Tensor:
        """One Euler step `sample + (t[i+1] - t[i]) * model_output`, computed in float32.

        Args:
            model_output: velocity, same shape as `sample`.
            step_index: i in `[0, N)`.
            sample: current latents.

        Returns:
            the next latents in `sample.dtype`.

        Raises:
            ValueError: if `set_timesteps` was not called or `step_index` is out of range.
        """
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        if not 0 <= step_index < self.num_inference_steps:
            raise ValueError(f"step_index {step_index} outside [0, {self.num_inference_steps})")
        dt = self.timesteps_with_end[step_index + 1] - self.timesteps_with_end[step_index]
        return (sample.float() + dt.to(sample.device) * model_output.float()).to(sample.dtype)
