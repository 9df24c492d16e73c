"""FlowMatchEulerScheduler: schedules against the upstream fixture (1e-6), Euler step, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from dit_reference import max_abs, outputs

from stage_dit.scheduling_flow_match import FlowMatchEulerScheduler


@pytest.mark.parametrize(
    ("steps", "num_tokens", "key"),
    [(8, 32 * 32, "sched_256_8_timesteps"), (50, 128 * 128, "sched_1024_50_timesteps"), (8, 8 * 8, "e2e_timesteps")],
)
def test_schedule_matches_upstream(steps, num_tokens, key):
    scheduler = FlowMatchEulerScheduler()
    timesteps = scheduler.set_timesteps(steps, num_tokens=num_tokens)
    assert timesteps.dtype == torch.float32 and timesteps.shape == (steps,)
    assert max_abs(timesteps, outputs()[key]) < 1e-6


def test_schedule_with_end_matches_upstream():
    scheduler = FlowMatchEulerScheduler()
    scheduler.set_timesteps(8, num_tokens=32 * 32)
    assert max_abs(scheduler.timesteps_with_end, outputs()["sched_256_8_timesteps_with_end"]) < 1e-6


def test_shift_formula_and_endpoints():
    scheduler = FlowMatchEulerScheduler()
    t = scheduler.set_timesteps(4, num_tokens=128 * 128)  # m = 128 / 40 = 3.2
    base = torch.tensor([0.0, 0.25, 0.5, 0.75])
    expected = base / (3.2 - 3.2 * base + base)
    assert max_abs(t, expected) < 1e-6
    assert t[0].item() == 0.0 and scheduler.timesteps_with_end[-1].item() == 1.0
    # m = 1 at 40x40 latent pixels: the uniform grid
    assert max_abs(scheduler.set_timesteps(4, num_tokens=1600), base) < 1e-7


def test_static_shift_when_dynamic_is_off():
    scheduler = FlowMatchEulerScheduler(dynamic_time_shift=False, shift=2.0)
    t = scheduler.set_timesteps(2)
    assert max_abs(t, torch.tensor([0.0, 0.5 / (2.0 - 1.0 + 0.5)])) < 1e-7


def test_euler_step_reaches_data_along_a_constant_velocity():
    scheduler = FlowMatchEulerScheduler()
    scheduler.set_timesteps(5, num_tokens=64 * 64)
    x0 = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    v = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(1))
    x = x0
    for i in range(5):
        step = scheduler.step(v, i, x)
        dt = (scheduler.timesteps_with_end[i + 1] - scheduler.timesteps_with_end[i]).item()
        assert max_abs(step, x + dt * v) < 1e-6
        x = step
    assert max_abs(x, x0 + v) < 1e-5  # the steps sum to t = 1


def test_step_keeps_sample_dtype():
    scheduler = FlowMatchEulerScheduler()
    scheduler.set_timesteps(2, num_tokens=16)
    out = scheduler.step(torch.ones(2, dtype=torch.bfloat16), 0, torch.zeros(2, dtype=torch.float32))
    assert out.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs",
    [{"num_train_timesteps": 0}, {"shift_base_len": 0.0}, {"dynamic_time_shift": True, "shift": 3.0}, {"shift": -1.0}],
)
def test_bad_configuration_is_rejected(kwargs):
    with pytest.raises(ValueError):
        FlowMatchEulerScheduler(**kwargs)


def test_bad_calls_are_rejected():
    scheduler = FlowMatchEulerScheduler()
    with pytest.raises(ValueError, match="set_timesteps"):
        scheduler.step(torch.zeros(1), 0, torch.zeros(1))
    for steps in (0, -3, 2.5):
        with pytest.raises(ValueError):
            scheduler.set_timesteps(steps, num_tokens=64)
    with pytest.raises(ValueError, match="num_tokens"):
        scheduler.set_timesteps(4)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(4, num_tokens=0)
    scheduler.set_timesteps(4, num_tokens=64)
    with pytest.raises(ValueError):
        scheduler.step(torch.zeros(1), 4, torch.zeros(1))


def test_config_round_trip():
    scheduler = FlowMatchEulerScheduler(dynamic_time_shift=False, shift=1.5)
    rebuilt = FlowMatchEulerScheduler.from_config(scheduler.config)
    assert rebuilt.config.shift == 1.5 and not rebuilt.config.dynamic_time_shift
    assert math.isclose(rebuilt.set_timesteps(3)[1].item(), scheduler.set_timesteps(3)[1].item())
