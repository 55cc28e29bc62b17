"""The objective's conventions against diffusers' flow-matching scheduler (what Wan's pipeline samples with)."""
import pytest
import torch

from data.keys import keyed_generator
from models.flow_matching import FlowMatching, ObjectiveConfig, shift_t
from training.step import draw_t_noise


def test_interpolation_and_timestep_match_diffusers_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    sched.set_timesteps(10)
    # the pipeline hands the model scheduler.timesteps = 1000·sigma; sigma is our t
    torch.testing.assert_close(sched.timesteps, sched.sigmas[:-1] * 1000)
    x0, eps = torch.randn(2, 4, 3, 4, 4), torch.randn(2, 4, 3, 4, 4)
    for i in (0, 4, 9):
        t = sched.sigmas[i]
        ours = (1 - t) * x0 + t * eps
        theirs = sched.scale_noise(x0, sched.timesteps[i:i + 1], eps)
        torch.testing.assert_close(ours, theirs)
    # a model that predicts our target v = eps − x0 exactly lands on x0 through diffusers' Euler steps
    x = eps.clone()
    for tstep in sched.timesteps:
        x = sched.step(eps - x0, tstep, x).prev_sample
    torch.testing.assert_close(x, x0, atol=1e-5, rtol=1e-5)
    # and the schedule's shift is Wan's shift of t
    u = torch.linspace(0.05, 0.95, 7)
    torch.testing.assert_close(shift_t(u, 3.0), 3.0 * u / (1 + 2.0 * u))


def test_draws_are_keyed_by_seed_epoch_and_sample():
    fm = FlowMatching(ObjectiveConfig(t_sampling="uniform", shift=1.0))
    t1, n1 = draw_t_noise(fm, ["a", "b"], (2, 3), seed=0, epoch=1)
    t2, n2 = draw_t_noise(fm, ["b", "a"], (2, 3), seed=0, epoch=1)
    assert torch.equal(t1, t2.flip(0)) and torch.equal(n1, n2.flip(0))  # order and batch mates do not matter
    t3, _ = draw_t_noise(fm, ["a"], (2, 3), seed=0, epoch=2)
    assert t3[0] != t1[0]
    assert torch.equal(torch.rand(3, generator=keyed_generator(1, "x")), torch.rand(3, generator=keyed_generator(1, "x")))


def test_logit_normal_with_shift_moves_t_up():
    fm = FlowMatching(ObjectiveConfig(t_sampling="logit_normal", shift=5.0))
    t, _ = draw_t_noise(fm, [str(i) for i in range(400)], (1,), seed=0, epoch=0)
    assert 0 < t.min() and t.max() < 1 and t.median() > 0.7  # shift 5 maps the median 0.5 to 5/6


def test_loss_is_zero_for_the_exact_velocity():
    x0, eps = torch.randn(3, 2, 1, 2, 2), torch.randn(3, 2, 1, 2, 2)
    t = torch.tensor([0.1, 0.5, 0.9])
    seen = {}

    def oracle(x_t, timestep, text):
        seen["timestep"] = timestep
        return eps - x0

    loss = FlowMatching.per_sample_loss(oracle, x0, torch.zeros(3, 4, 8), t, eps)
    assert loss.shape == (3,) and loss.abs().max() == 0
    torch.testing.assert_close(seen["timestep"], 1000 * t)


def _scheduler(**kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **kw)


def test_model_input_and_target_are_diffusers_forward_process_and_euler_velocity():
    """What the model receives, against diffusers as a peer: x_t is FlowMatchEulerDiscreteScheduler.scale_noise at
    the same sigma (looked up by timestep = 1000·sigma), the timestep is the scheduler's, and the target is the
    velocity that one Euler step of diffusers' scheduler integrates from x_t to the next sigma."""
    steps, idx = 8, [0, 3, 6]
    sched = _scheduler(shift=3.0)
    sched.set_timesteps(steps)
    gen = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(3, 4, 2, 4, 4, generator=gen), torch.randn(3, 4, 2, 4, 4, generator=gen)
    t = sched.sigmas[idx]
    ts_now, ts_next = sched.timesteps[idx], sched.timesteps[[i + 1 for i in idx]]
    x_now = torch.cat([sched.scale_noise(x0[k:k + 1], ts_now[k:k + 1], eps[k:k + 1]) for k in range(3)])
    x_next = torch.cat([sched.scale_noise(x0[k:k + 1], ts_next[k:k + 1], eps[k:k + 1]) for k in range(3)])
    # the velocity that carries diffusers' x from sigma_i to sigma_{i+1} in one Euler step of its own scheduler
    v = (x_next - x_now) / (sched.sigmas[[i + 1 for i in idx]] - t).view(-1, 1, 1, 1, 1)
    for k, i in enumerate(idx):
        step = _scheduler(shift=3.0)
        step.set_timesteps(steps)
        step.set_begin_index(i)  # its first step starts at sigma_i
        torch.testing.assert_close(step.step(v[k:k + 1], ts_now[k], x_now[k:k + 1]).prev_sample, x_next[k:k + 1])
    seen = {}

    def model(x_t, timestep, text):
        seen["x_t"], seen["timestep"] = x_t.clone(), timestep.clone()
        return v

    loss = FlowMatching.per_sample_loss(model, x0, torch.zeros(3, 4, 8), t, eps)
    torch.testing.assert_close(seen["x_t"], x_now, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(seen["timestep"], ts_now.float(), atol=1e-3, rtol=0)
    assert loss.shape == (3,) and loss.max() < 1e-9, loss  # diffusers' velocity is our target
    # and a model off by δ everywhere pays δ²: the loss is the plain mean square, per sample
    loss_off = FlowMatching.per_sample_loss(lambda x_t, ts, text: v + 0.5, x0, torch.zeros(3, 4, 8), t, eps)
    torch.testing.assert_close(loss_off, torch.full((3,), 0.25), atol=1e-5, rtol=0)


class ToPoint(torch.nn.Module):
    """The exact velocity field of the flow to one data point x0 under diffusers' forward process
    (x_σ = (1 − σ)·x0 + σ·ε): v(x, σ) = (x − x0) / σ, read from the timestep it is given (σ = timestep / 1000)."""

    def __init__(self, x0):
        super().__init__()
        self.x0, self.calls, self.modes = x0, [], []

    def forward(self, x, timestep, text):
        self.calls.append((x.clone(), timestep.clone()))
        self.modes.append(self.training)
        return (x - self.x0) / (timestep.double() / 1000).view(-1, *([1] * (x.dim() - 1))).float()


def test_sampler_steps_are_diffusers_euler_steps_and_the_objective_trains_their_velocity():
    """Our sampler (models/sampler.py) against diffusers' Euler scheduler on the same sigmas, both driven by the exact
    velocity field to a point x0: the same inputs and timesteps at every step, and both land on x0. The objective
    gives that field zero loss at every t, so the velocity it trains is the one both samplers integrate."""
    from models.sampler import initial_noise, sample_latents, sampling_times

    steps, shift, shape = 5, 3.0, (4, 2, 4, 4)
    x0 = torch.randn(1, *shape, generator=torch.Generator().manual_seed(1))
    eps = initial_noise(7, shape)[None]
    ours = ToPoint(x0).train()
    out = sample_latents(ours, torch.zeros(1, 4, 8), torch.zeros(4, 8), shape, [7], steps=steps, guidance=1.0,
                         shift=shift)
    assert ours.modes == [False] * steps and ours.training  # sampled in eval mode, training mode given back
    times = sampling_times(steps, shift)
    sched = _scheduler(shift=1.0)  # our times are already shifted
    sched.set_timesteps(sigmas=times[:-1].float().tolist())
    theirs = ToPoint(x0)
    x = eps.clone()
    for ts in sched.timesteps:
        x = sched.step(theirs(x, ts.view(1), None), ts, x).prev_sample
    assert len(ours.calls) == len(theirs.calls) == steps
    for (x_a, ts_a), (x_b, ts_b) in zip(ours.calls, theirs.calls):
        torch.testing.assert_close(x_a, x_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ts_a, ts_b, atol=1e-3, rtol=0)
    torch.testing.assert_close(out, x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, x0, atol=1e-4, rtol=1e-4)
    # the objective: this field predicts its target exactly at every t (x0 repeated, one ε per t)
    t = torch.tensor([0.05, 0.3, 0.6, 0.95])
    noise = torch.randn(4, *shape, generator=torch.Generator().manual_seed(2))
    loss = FlowMatching.per_sample_loss(ToPoint(x0), x0.expand(4, *shape), torch.zeros(4, 4, 8), t, noise)
    assert loss.max() < 1e-9, loss


def test_sample_config_refuses_what_cannot_sample():
    from models.sampler import SampleConfig

    for bad, field in (({"steps": 0}, "steps"), ({"guidance": 0.5}, "guidance"), ({"shift": 0.0}, "shift"),
                       ({"fps": 0.0}, "fps"), ({"seeds": []}, "seeds")):
        with pytest.raises(ValueError, match=f"sample.{field}"):
            SampleConfig(**bad)
    assert SampleConfig(fps=0.5, guidance=1.0, steps=1).fps == 0.5


def test_the_keyed_draw_takes_t_then_the_noise_from_one_generator_per_sample():
    """The stream every run's losses depend on: per key, generator (seed, epoch, key) → one scalar for t → noise."""
    fm = FlowMatching(ObjectiveConfig(t_sampling="logit_normal", logit_mean=0.2, logit_std=1.5, shift=3.0))
    t, noise = draw_t_noise(fm, ["k7"], (2, 3), seed=4, epoch=1)
    g = keyed_generator(4, 1, "k7")
    want_t = shift_t(torch.sigmoid(0.2 + 1.5 * torch.randn((), generator=g)), 3.0)
    assert torch.equal(t[0], want_t) and torch.equal(noise[0], torch.randn(2, 3, generator=g))
