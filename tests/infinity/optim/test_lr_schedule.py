"""DeepSpeed's warmup schedules against values worked out by hand from its formulas."""

import math

import pytest

from infinity.optim.lr_schedule import WarmupCosineLR, WarmupDecayLR, WarmupLR


def test_log_warmup_by_hand():
    s = WarmupLR(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)
    assert s.lr_at(-1) == 0.0  # before the first scheduler step: the minimum
    assert s.lr_at(0) == 0.0  # log(1) = 0
    assert s.lr_at(1) == pytest.approx(0.30103, abs=1e-5)  # log(2) / log(10)
    assert s.lr_at(4) == pytest.approx(0.69897, abs=1e-5)  # log(5) / log(10)
    assert s.lr_at(9) == pytest.approx(1.0)  # log(10) / log(10)
    assert s.lr_at(10) == s.lr_at(10_000) == 1.0


def test_linear_warmup_by_hand():
    s = WarmupLR(warmup_min_lr=0.1, warmup_max_lr=0.5, warmup_num_steps=4, warmup_type="linear")
    assert [s.lr_at(k) for k in range(-1, 6)] == pytest.approx([0.1, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5])


@pytest.mark.parametrize("steps", [0, 1, 2])
def test_warmup_is_at_least_two_steps(steps):
    s = WarmupLR(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=steps)
    assert s.effective_warmup_steps == 2
    assert (s.lr_at(0), s.lr_at(1), s.lr_at(2)) == (0.0, 1.0, 1.0)


def test_warmup_decay_by_hand():
    s = WarmupDecayLR(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10,
                      warmup_type="linear", total_num_steps=110)
    assert s.lr_at(5) == pytest.approx(0.5)  # warmup 5 / 10
    assert s.lr_at(10) == pytest.approx(1.0)  # (110 - 10) / (110 - 10)
    assert s.lr_at(60) == pytest.approx(0.5)  # (110 - 60) / 100
    assert s.lr_at(109) == pytest.approx(0.01)
    assert s.lr_at(110) == 0.0 and s.lr_at(500) == 0.0  # never negative


def test_warmup_cosine_by_hand():
    s = WarmupCosineLR(base_lr=2.0, total_num_steps=20, warmup_num_steps=10,
                       warmup_type="linear", warmup_min_ratio=0.5)
    assert s.lr_at(-1) == 0.0  # DeepSpeed's cosine starts from 0 before its first step
    assert s.lr_at(0) == pytest.approx(1.0)  # 2 * 0.5
    assert s.lr_at(5) == pytest.approx(1.5)  # 2 * (0.5 + 0.5 * 5/10)
    # step 10: progress (10 - 10 + 1) / (20 - 10) = 0.1
    ratio = 1e-4 + (1 - 1e-4) * (1 + math.cos(0.1 * math.pi)) / 2
    assert s.lr_at(10) == pytest.approx(2.0 * ratio)
    assert s.lr_at(14) == pytest.approx(2.0 * (1e-4 + (1 - 1e-4) * 0.5))  # progress 0.5
    assert s.lr_at(19) == pytest.approx(2e-4) and s.lr_at(100) == pytest.approx(2e-4)


def test_warmup_cosine_log_warmup_by_hand():
    s = WarmupCosineLR(base_lr=1.0, total_num_steps=1000, warmup_num_steps=100)
    assert s.ratio_at(9) == pytest.approx(math.log(10) / math.log(100))  # = 0.5
    assert s.ratio_at(9) == pytest.approx(0.5)


def test_schedules_are_pure_and_frozen():
    s = WarmupLR(warmup_max_lr=1.0, warmup_num_steps=10)
    assert [s.lr_at(3) for _ in range(3)] == [s.lr_at(3)] * 3
    with pytest.raises(AttributeError):
        s.warmup_max_lr = 2.0


@pytest.mark.parametrize("make, name", [
    (lambda: WarmupLR(warmup_type="exp"), "warmup_type"),
    (lambda: WarmupLR(warmup_min_lr=1.0, warmup_max_lr=0.5), "warmup_max_lr"),
    (lambda: WarmupLR(warmup_num_steps=-1), "warmup_num_steps"),
    (lambda: WarmupLR(warmup_max_lr=math.inf), "warmup_max_lr"),
    (lambda: WarmupDecayLR(total_num_steps=0), "total_num_steps"),
    (lambda: WarmupCosineLR(total_num_steps=10, cos_min_ratio=1.5), "cos_min_ratio"),
    (lambda: WarmupCosineLR(total_num_steps=10, base_lr=-1.0), "base_lr"),
])
def test_bad_numbers_are_refused(make, name):
    with pytest.raises(ValueError, match=name):
        make()
