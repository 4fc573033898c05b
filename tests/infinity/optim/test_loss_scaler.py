"""DynamicLossScaler: DeepSpeed's growth window, hysteresis and floor."""

import pytest

from infinity.optim.loss_scaler import DynamicLossScaler


def test_grows_after_a_clean_window():
    s = DynamicLossScaler(scale=8.0, window=3)
    for _ in range(2):
        s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0


def test_hysteresis_then_backoff_to_the_floor():
    s = DynamicLossScaler(scale=4.0, window=100, hysteresis=2, min_scale=1.0)
    s.update(True)
    assert s.scale == 4.0  # first overflow tolerated
    s.update(True)
    assert s.scale == 2.0
    for _ in range(10):
        s.update(True)
    assert s.scale == 1.0


def test_state_round_trip_and_validation():
    s = DynamicLossScaler(scale=32.0, window=2)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match="window"):
        DynamicLossScaler(window=0)
