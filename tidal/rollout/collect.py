"""One step's samples from the rollout role: scalar rewards (+ DAPO's overlong penalty), dynamic
sampling, and the rollout metrics."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

from tidal.algo import Groups, groups_with_signal, overlong_penalty
from tidal.algo.options import AlgoConfig
from tidal.data.source import DataSource
from tidal.reward.score import scalar_reward
from tidal.rollout.manager import RolloutManager, group_sizes
from tidal.types import Sample, Status
from tidal.utils import load_object


def rollout_metrics(samples: list[Sample], rewards: torch.Tensor, group: Groups) -> dict[str, float]:
    """The step's reward and response metrics; `group` is the batch's groups (an int, or each
    group's size). `reward/equal_reward_groups` is the share of groups, whatever their sizes, whose
    rewards are all equal (at least two samples, max == min): a group-relative estimator gives
    them zero advantage, whether every sample earned 1 or every sample earned 0 (docs/metrics.md)."""
    lengths = [s.response_length for s in samples]
    # equal = ~(spread or < 2 samples): a 1-sample group is never counted (there is nothing to
    # compare), and a NaN reward counts as spread
    unequal = groups_with_signal(rewards, group) | (torch.as_tensor(_sizes(group, len(samples))) < 2)
    # a dict reward's numeric entries are logged as rewards/<key> (mean over samples that have it)
    parts: dict[str, list[float]] = {}
    for s in samples:
        if isinstance(s.reward, dict):
            for k, v in s.reward.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    parts.setdefault(f"rewards/{k}", []).append(float(v))
    return {
        **{k: statistics.fmean(v) for k, v in parts.items()},
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward/equal_reward_groups": float((~unequal).float().mean()),
        "response/length_mean": statistics.fmean(lengths),
        "response/length_max": float(max(lengths)),
        "response/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "response/failed_ratio": sum(s.status == Status.FAILED for s in samples) / len(samples),
    }


def _sizes(group: Groups, n: int) -> list[int]:
    return [group] * (n // group) if isinstance(group, int) else list(group)


def shaped_rewards(samples: list[Sample], algo: AlgoConfig, reward_key: str, max_new_tokens: int) -> torch.Tensor:
    """[N] scalar rewards, plus DAPO's soft overlong penalty when `algo.overlong_buffer` is set."""
    rewards = torch.tensor([scalar_reward(s, reward_key) for s in samples], dtype=torch.float32)
    if algo.overlong_buffer:
        lengths = torch.tensor([s.response_length for s in samples])
        rewards = rewards + overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
    return rewards


def _user_keeps(keep: Callable[[list[Sample]], bool], name: str, group: list[Sample]) -> bool:
    """`algo.dynamic_sampling_filter`'s verdict on one group; a non-bool answer is refused, since a
    truthy tensor or count would silently keep groups the user meant to drop."""
    verdict = keep(group)
    if not isinstance(verdict, bool):
        raise TypeError(
            f"algo.dynamic_sampling_filter: {name} returned {type(verdict).__name__}, expected a bool "
            "(True keeps the group)"
        )
    return verdict


def collect(
    source: DataSource, rollout: RolloutManager, step: int, algo: AlgoConfig, reward_key: str
) -> tuple[list[Sample], dict[str, float]]:
    """One step's samples. With `algo.dynamic_sampling` (DAPO), groups whose rewards are all equal
    carry no signal and are dropped (or, with `algo.dynamic_sampling_filter`, the groups that user
    function says no to; it sees each group's scored samples, failed ones included); more prompts
    are sampled (up to `max_sampling_rounds` rounds) until `rollout_batch_size` groups remain. If
    the rounds run out, the batch is topped up with dropped groups and the shortfall is logged."""
    r = rollout.rollout
    if not algo.dynamic_sampling:
        return rollout.generate(source.next_batch(), step), {}
    keep = load_object(algo.dynamic_sampling_filter, callable_required=True) if algo.dynamic_sampling_filter else None
    need = r.rollout_batch_size
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    drawn = rounds = groups_drawn = 0
    while len(kept) < need and rounds < algo.max_sampling_rounds:
        prompts = math.ceil((need - len(kept)) * algo.oversample)
        samples = rollout.generate(source.next_batch(prompts), step, first_index=drawn)
        drawn += len(samples)
        rounds += 1
        sizes = group_sizes(samples)  # whole groups are kept or dropped, whatever their sizes
        groups_drawn += len(sizes)
        rewards = shaped_rewards(samples, algo, reward_key, r.response_budget)
        valid = torch.tensor([s.status != Status.FAILED for s in samples])
        signal = groups_with_signal(rewards, sizes, valid) if keep is None and samples else None
        start = 0
        for g, size in enumerate(sizes):
            group = samples[start : start + size]
            start += size
            ok = bool(signal[g]) if keep is None else _user_keeps(keep, algo.dynamic_sampling_filter, group)
            (kept if ok else dropped).append(group)
    filled = max(0, need - len(kept))
    groups = kept[:need] + dropped[:filled]
    out = []
    for g, group in enumerate(groups):  # renumber: the trainer sees one contiguous batch
        for s in group:
            s.group_index, s.index = g, len(out)
            out.append(s)
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/groups_sampled": float(groups_drawn),
        "dynamic_sampling/groups_kept": float(len(kept)),
        "dynamic_sampling/filled_without_signal": float(filled),
    }
    return out, metrics
