"""The objective's conventions against diffusers' flow-matching scheduler (what Wan's pipeline samples with)."""
import torch

from models.flow_matching import FlowMatching, ObjectiveConfig, keyed_generator, shift_t


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
    t1, n1 = fm.draw(["a", "b"], (2, 3), seed=0, epoch=1)
    t2, n2 = fm.draw(["b", "a"], (2, 3), seed=0, epoch=1)
    assert torch.equal(t1, t2.flip(0)) and torch.equal(n1, n2.flip(0))  # order and batch mates do not matter
    t3, _ = fm.draw(["a"], (2, 3), seed=0, epoch=2)
    assert t3[0] != t1[0]
    assert torch.equal(torch.rand(3, generator=keyed_generator(1, "x")), torch.rand(3, generator=keyed_generator(1, "x")))


def test_logit_normal_with_shift_moves_t_up():
    fm = FlowMatching(ObjectiveConfig(t_sampling="logit_normal", shift=5.0))
    t, _ = fm.draw([str(i) for i in range(400)], (1,), seed=0, epoch=0)
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
