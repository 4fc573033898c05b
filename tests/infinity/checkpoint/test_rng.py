"""RNG states saved in a checkpoint make a resumed process draw the same numbers."""

import random

import numpy as np
import pytest
import torch

from infinity.checkpoint import CheckpointReader, CheckpointWriter
from infinity.checkpoint.rng import load_rng_state, rng_state, save_rng_state
from infinity.errors import CheckpointError


def _draws():
    return (torch.rand(5).tolist(), np.random.rand(5).tolist(), [random.random() for _ in range(5)],
            np.random.randn(3).tolist(), random.gauss(0, 1))


def test_restored_rng_states_repeat_the_draws(tmp_path):
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    np.random.randn(1), random.gauss(0, 1)  # cached gaussians are part of the state
    with CheckpointWriter(tmp_path, "step1") as writer:
        save_rng_state(writer)
    expected = _draws()
    _draws()
    load_rng_state(CheckpointReader(tmp_path))
    assert _draws() == expected


def test_each_rank_gets_its_own_states_and_a_new_rank_rank_0s(tmp_path, caplog):
    """Data-parallel ranks: rank r's states come back to rank r; a rank the checkpoint did not
    have (resumed on more ranks) starts from rank 0's, and the log says so."""
    states, expected = [], []
    for seed in (10, 11):
        torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
        states.append(rng_state())
        expected.append(_draws())
    with CheckpointWriter(tmp_path, "step1") as writer:
        for rank, state in enumerate(states):
            save_rng_state(writer, state, rank=rank)
    for rank, want in ((1, expected[1]), (0, expected[0]), (2, expected[0])):
        load_rng_state(CheckpointReader(tmp_path), rank=rank)
        assert _draws() == want, rank
    assert "holds no RNG state of rank 2" in caplog.text


def test_a_checkpoint_without_rng_state_says_so(tmp_path):
    with CheckpointWriter(tmp_path, "step1") as writer:
        writer.add("w", torch.ones(1))
    with pytest.raises(CheckpointError, match="holds no RNG state"):
        load_rng_state(CheckpointReader(tmp_path))


@pytest.mark.requires_cuda
def test_cuda_rng_states_are_restored(tmp_path):
    torch.cuda.manual_seed_all(7)
    with CheckpointWriter(tmp_path, "step1") as writer:
        save_rng_state(writer)
    expected = torch.rand(4, device="cuda").tolist()
    load_rng_state(CheckpointReader(tmp_path))
    assert torch.rand(4, device="cuda").tolist() == expected
