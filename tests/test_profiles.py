"""Profile selection: env var, CI, CUDA, and the sizes each profile promises."""

import pytest

from minimind_lib.memory import estimate_memory
from minimind_lib.model import MiniMindConfig
from minimind_lib.profiles import PROFILES, get_profile, select_profile_name


@pytest.mark.parametrize(
    "env, cuda, expected",
    [
        ({"MINIMIND_PROFILE": "gpu"}, False, "gpu"),  # explicit choice wins, even without CUDA
        ({"MINIMIND_PROFILE": "cpu", "CI": "true"}, True, "cpu"),  # and wins over CI
        ({"MINIMIND_PROFILE": " Smoke "}, False, "smoke"),  # case and spaces forgiven
        ({"MINIMIND_PROFILE": "workshop", "CI": "true"}, True, "workshop"),
        ({"CI": "true"}, True, "smoke"),
        ({"CI": "1"}, False, "smoke"),
        ({"CI": "false"}, True, "gpu"),  # CI=false is not CI
        ({}, True, "gpu"),
        ({}, False, "cpu"),
    ],
)
def test_selection_order(env, cuda, expected):
    assert select_profile_name(env, cuda_available=cuda) == expected


def test_unknown_profile_names_the_choices():
    with pytest.raises(ValueError, match=r"MINIMIND_PROFILE='huge'.*\['cpu', 'gpu', 'gpu-check', 'smoke', 'workshop'\]"):
        select_profile_name({"MINIMIND_PROFILE": "huge"}, cuda_available=False)
    with pytest.raises(ValueError, match="unknown profile 'huge'"):
        get_profile("huge")


def test_profiles_are_ordered_by_size():
    smoke, workshop, cpu, gpu = (PROFILES[name] for name in ("smoke", "workshop", "cpu", "gpu"))
    assert gpu.model == "minimind2-small" and gpu.seq_len == 512
    for field in ("seq_len", "max_tokens"):
        assert getattr(smoke, field) <= getattr(workshop, field) <= getattr(cpu, field) <= getattr(gpu, field), field
    for stage in ("pretrain_steps", "sft_steps"):  # the work of a run: tokens x parameters (workshop: more
        # tokens than cpu, through a smaller model)
        work = [getattr(p, stage) * p.accum_steps * p.max_tokens * estimate_memory(
            MiniMindConfig.preset(p.model), 1, 8)["n_params"] for p in (smoke, workshop, cpu, gpu)]
        assert work == sorted(work), (stage, work)
    for p in PROFILES.values():
        assert p.max_tokens == p.batch_size * p.seq_len  # one micro-batch size: batch_size full rows
        assert 1 <= p.eval_every <= p.pretrain_steps  # SFT validates at its end whatever eval_every says


def test_gpu_check_profile_is_the_gpu_run_sized_for_minutes():
    gpu, check = PROFILES["gpu"], PROFILES["gpu-check"]
    assert (check.model, check.seq_len, check.max_tokens) == (gpu.model, gpu.seq_len, gpu.max_tokens)
    for stage in ("train_steps", "pretrain_steps", "sft_steps"):
        assert getattr(check, stage) < getattr(gpu, stage), stage
    assert check.eval_every == check.pretrain_steps > check.sft_steps  # validation and checkpoints at the end only


def test_overrides_do_not_touch_the_registry():
    p = get_profile("smoke", seq_len=64)
    assert p.seq_len == 64 and PROFILES["smoke"].seq_len == 128
    assert p.to_dict()["name"] == "smoke"
