"""build_lr_schedule: the `scheduler` section -> infinity.optim's pure lr_at(step) records."""

import pytest

from infinity.config import load_config
from infinity.engine import build_lr_schedule
from infinity.optim import WarmupCosineLR, WarmupDecayLR, WarmupLR


def _schedule(kind: str, params: dict, lr: float = 0.5, **kwargs):
    config = load_config({"scheduler": {"type": kind, "params": params}})
    return build_lr_schedule(config.scheduler, optimizer_lr=lr, **kwargs)


def test_warmup_lr_tops_out_at_the_optimizer_lr_by_default():
    s = _schedule("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"})
    assert s == WarmupLR(warmup_min_lr=0.0, warmup_max_lr=0.5, warmup_num_steps=4,
                         warmup_type="linear")
    assert s.lr_at(2) == pytest.approx(0.25)


def test_warmup_decay_from_the_section():
    s = _schedule("WarmupDecayLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2,
                                    "warmup_num_steps": 10, "total_num_steps": 30})
    assert isinstance(s, WarmupDecayLR) and s.total_num_steps == 30
    assert s.lr_at(20) == pytest.approx(0.1 + 0.1 * 10 / 20)


def test_cosine_is_a_ratio_of_the_optimizer_lr():
    s = _schedule("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 10,
                                     "warmup_min_ratio": 0.2, "warmup_type": "linear"}, lr=2.0)
    assert isinstance(s, WarmupCosineLR) and s.base_lr == 2.0
    assert s.lr_at(0) == pytest.approx(0.4) and s.lr_at(19) == pytest.approx(2e-4)


def test_a_total_in_the_config_wins_over_the_callers():
    s = _schedule("WarmupDecayLR", {"warmup_num_steps": 10, "total_num_steps": 50},
                  total_num_steps=999)
    assert s.total_num_steps == 50
