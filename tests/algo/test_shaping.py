"""DAPO overlong penalty and dynamic-sampling group filter against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from tidal.algo import groups_with_signal, overlong_penalty

NAN = float("nan")


def test_overlong_penalty_hand_values():
    # max_len 20, buffer 5 -> soft limit 15; ramp -(L - 15)/5: 16 -> -0.2, 18 -> -0.6, 20 -> -1
    lengths = torch.tensor([10, 15, 16, 18, 20, 21, 100])
    out = overlong_penalty(lengths, max_len=20, buffer=5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0]))
    # factor scales everything: 16 -> -0.2 * 0.5 = -0.1, beyond max_len -> -0.5
    out = overlong_penalty(lengths, max_len=20, buffer=5, factor=0.5)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5, -0.5]))
    # buffer == max_len: soft limit 0, so 1 token already costs 1/20
    out = overlong_penalty(torch.tensor([0, 1, 20], dtype=torch.float64), max_len=20, buffer=20)
    torch.testing.assert_close(out, torch.tensor([0.0, -0.05, -1.0], dtype=torch.float64))


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=0)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=11)
    with pytest.raises(ValueError, match="1-D"):
        overlong_penalty(torch.ones(2, 2), max_len=10, buffer=2)


def test_groups_with_signal_hand_values():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, NAN, 1.0, 1.0, 2.0, NAN, NAN, 0.5, NAN, 0.7])
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool)
    # groups of 3: [1, 1, 1] all equal -> False; [0, 1, 0] -> True; [-, 1, 1] equal -> False;
    # [2, -, -] one valid member -> False; [0.5, -, 0.7] differ -> True
    out = groups_with_signal(rewards, 3, valid=valid)
    assert out.dtype == torch.bool
    assert out.tolist() == [False, True, False, False, True]
    # without `valid` every entry counts
    assert groups_with_signal(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2).tolist() == [False, True]
    # groups of one never carry signal
    assert groups_with_signal(torch.tensor([0.0, 1.0]), 1).tolist() == [False, False]


def test_groups_with_signal_errors():
    with pytest.raises(ValueError, match="divisible"):
        groups_with_signal(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size"):
        groups_with_signal(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="valid"):
        groups_with_signal(torch.zeros(4), 2, valid=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="1-D"):
        groups_with_signal(torch.zeros(2, 2), 2)
