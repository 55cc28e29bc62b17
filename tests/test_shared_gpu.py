"""launch.debug_share_gpu (training/shared_gpu.py): its refusals on a machine without a GPU, the round-robin
placement, and a staged collective's copies. The two-rank FSDP2 step with every collective staged is
tests/test_distributed.py's "staged" case; the GPU run itself is scripts/h200_two_ranks.sh."""
import pytest
import torch

from training.config import LaunchConfig
from training.dist import check_devices
from training.shared_gpu import _Done, device_for, ranks_per_device, staged


def test_the_mode_is_checked_where_it_is_declared():
    assert LaunchConfig(debug_share_gpu="host").debug_share_gpu == "host"
    with pytest.raises(ValueError, match="launch.debug_share_gpu must be null or one of"):
        LaunchConfig(debug_share_gpu="yes")


def test_without_a_gpu_sharing_one_is_refused_before_anything_starts():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    with pytest.raises(ValueError, match="this machine has none"):
        check_devices(2, "auto", "gloo")
    with pytest.raises(ValueError, match="choose one"):
        check_devices(2, "cpu", "gloo")


def test_ranks_share_the_gpus_round_robin():
    assert [device_for(r, 1).index for r in range(3)] == [0, 0, 0]
    assert [device_for(r, 2).index for r in range(4)] == [0, 1, 0, 1]
    assert ranks_per_device(2, 1, 1) == 2 and ranks_per_device(3, 2, 0) == 2 and ranks_per_device(3, 2, 1) == 1
    with pytest.raises(ValueError, match="this machine has none"):
        device_for(0, 0)


def test_a_staged_collective_runs_on_copies_and_writes_back_only_its_output():
    seen = []

    def collective(output, inp, group=None, async_op=False):  # all_gather_into_tensor's shape of call
        seen.append((output, inp, async_op))
        output.copy_(torch.cat([inp, inp * 2]))
        inp.mul_(-1)  # a backend that scribbles on its input: the caller's tensor must not see it

    marked = {"x"}
    stage = lambda t: getattr(t, "_tag", None) in marked  # noqa: E731 - "on the device" for this test
    out, inp = torch.zeros(4), torch.tensor([1.0, 2.0])
    out._tag, inp._tag = "x", "x"
    work = staged(collective, stage)(out, inp, async_op=True)
    assert isinstance(work, _Done) and work.wait()
    assert out.tolist() == [1.0, 2.0, 2.0, 4.0] and inp.tolist() == [1.0, 2.0]
    host_out, host_inp, async_op = seen[0]
    assert host_out is not out and host_inp is not inp and async_op is False  # ran synchronously, on copies
    out2 = torch.zeros(4)
    out2._tag = "x"
    assert staged(collective, stage)(output=out2, inp=torch.tensor([3.0, 4.0])) is None  # by keyword, unstaged input
    assert out2.tolist() == [3.0, 4.0, 6.0, 8.0]
    plain, plain_in = torch.zeros(4), torch.tensor([5.0, 6.0])
    staged(collective, stage)(plain, plain_in)  # nothing to stage: the collective itself, on the caller's tensors
    assert seen[-1][0] is plain and plain_in.tolist() == [-5.0, -6.0]


def test_one_process_draws_its_random_init_on_the_host_as_rank_0_of_a_sharded_run(monkeypatch):
    """Found by the two-rank GPU rehearsal: one process on a GPU drew its init with the CUDA generator, rank 0 of a
    sharded run with the CPU one, so the two started from different weights."""
    import models.build as build
    from models.config import ModelConfig

    drawn_on, real = [], build.build_model
    monkeypatch.setattr(build, "build_model", lambda cfg, device="cpu": drawn_on.append(str(device)) or real(cfg, device))
    cfg = ModelConfig(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16,
                      freq_dim=16, ffn_dim=32, num_layers=1, text_len=4)
    torch.manual_seed(0)
    model = build.build_parallel_model(cfg, 0, 1, torch.device("meta"))
    assert drawn_on == ["cpu"] and all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    on_host = build.build_parallel_model(cfg, 0, 1, torch.device("cpu"))
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(on_host.state_dict().values(), real(cfg, "cpu").state_dict().values()))


def test_too_few_gpus_is_refused_with_only_the_ways_that_can_work(monkeypatch):
    """A one-GPU preset on a machine without a GPU cannot lower its processes; with some GPUs the advice names how
    many there are."""
    import torch

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"has 0 GPU\(s\): run it where there are, or set launch\.device=cpu") as e:
        check_devices(1, "cuda")
    assert "num_processes" not in str(e.value).split("GPU(s):")[1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"has 2 GPU\(s\): run it where there are, lower launch\.num_processes to 2, "
                                         r"or set launch\.device=cpu"):
        check_devices(8, "cuda")
