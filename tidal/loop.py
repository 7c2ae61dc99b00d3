"""The synchronous RL loop, top to bottom: rollout → rewards → advantages → train → weight sync.

for step in steps:
    samples  = collect(data, rollout)                   # engine samples + log-probs, rewards (+ DAPO filter)
    rewards  = scalar rewards (+ overlong penalty)
    logp/ref/teacher/values = forward passes, only those the algorithm needs
    adv      = compute_advantages(algo, ...)            # tidal.algo, pure
    metrics  = actor.train_step(samples, adv)           # micro-batches or packing, AdamW, clip
    critic.train_step(samples, returns)                 # ppo only
    engine.update_weights(actor.weights, step+1)        # next rollout sees the new policy
    checkpoint every train.save_interval steps

`algo.mode: sft` runs the same trainer on chat data, with no rollout.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tidal.algo import groups_with_signal, overlong_penalty
from tidal.config import AlgoConfig, Config, DataConfig
from tidal.convert import ensure_model
from tidal.data.dataset import PromptRecord, build_prompts, load_prompts
from tidal.data.envs import make_env_rows
from tidal.data.sft import load_sft_samples
from tidal.data.source import DataSource
from tidal.engine.base import Engine
from tidal.engine.factory import make_engine
from tidal.hardware import cpu_info, resolve_dtype
from tidal.log import MetricsLogger, print_reward_table
from tidal.rollout.manager import RolloutManager
from tidal.rollout.rewards import scalar_reward
from tidal.train.actor import Actor
from tidal.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tidal.train.critic import Critic
from tidal.train.estimate import compute_advantages
from tidal.types import Sample, Status
from tidal.utils import atomic_write_json

log = logging.getLogger("tidal")


def load_data(cfg: DataConfig, tokenizer) -> list[PromptRecord]:
    """Prompt records from a file or a built-in env, with over-long prompts dropped (and counted)."""
    kw = dict(
        input_key=cfg.input_key,
        label_key=cfg.label_key,
        metadata_key=cfg.metadata_key,
        apply_chat_template=cfg.apply_chat_template,
        system_prompt=cfg.system_prompt,
        max_prompt_length=cfg.max_prompt_length,
    )
    if cfg.path.startswith("env:"):
        name = cfg.path[len("env:") :]
        records, dropped = build_prompts(make_env_rows(name, **cfg.env_args), tokenizer, source=cfg.path, **kw)
    else:
        records, dropped = load_prompts(cfg.path, tokenizer, **kw)
    log.info(
        "data: %d prompts from %s, %d dropped as longer than %d tokens",
        len(records),
        cfg.path,
        dropped,
        cfg.max_prompt_length,
    )
    if not records:
        raise ValueError(f"data.path {cfg.path}: no prompts left after dropping {dropped} over-long ones")
    return records


def rollout_metrics(samples: list[Sample], rewards: torch.Tensor, group: int) -> dict[str, float]:
    lengths = [s.response_length for s in samples]
    by_group = rewards.view(-1, group)
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
        "reward/solved_groups": float((by_group.std(dim=1) == 0).float().mean()),
        "response/length_mean": statistics.fmean(lengths),
        "response/length_max": float(max(lengths)),
        "response/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "response/failed_ratio": sum(s.status == Status.FAILED for s in samples) / len(samples),
    }


def shaped_rewards(samples: list[Sample], algo: AlgoConfig, reward_key: str, max_new_tokens: int) -> torch.Tensor:
    """[N] scalar rewards, plus DAPO's soft overlong penalty when `algo.overlong_buffer` is set."""
    rewards = torch.tensor([scalar_reward(s, reward_key) for s in samples], dtype=torch.float32)
    if algo.overlong_buffer:
        lengths = torch.tensor([s.response_length for s in samples])
        rewards = rewards + overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
    return rewards


def collect(
    source: DataSource, rollout: RolloutManager, step: int, algo: AlgoConfig, reward_key: str
) -> tuple[list[Sample], dict[str, float]]:
    """One step's samples. With `algo.dynamic_sampling` (DAPO), groups whose rewards are all equal
    carry no signal and are dropped; more prompts are sampled (up to `max_sampling_rounds` rounds)
    until `rollout_batch_size` groups remain. If the rounds run out, the batch is topped up with
    dropped groups (their group-relative advantage is 0) and the shortfall is logged."""
    r = rollout.cfg
    if not algo.dynamic_sampling:
        return rollout.generate(source.next_batch(), step), {}
    n, need = r.n_samples_per_prompt, r.rollout_batch_size
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    drawn = rounds = 0
    while len(kept) < need and rounds < algo.max_sampling_rounds:
        prompts = math.ceil((need - len(kept)) * algo.oversample)
        samples = rollout.generate(source.next_batch(prompts), step, first_index=drawn)
        drawn += len(samples)
        rounds += 1
        rewards = shaped_rewards(samples, algo, reward_key, r.max_new_tokens)
        valid = torch.tensor([s.status != Status.FAILED for s in samples])
        signal = groups_with_signal(rewards, n, valid)
        for g in range(len(samples) // n):
            (kept if signal[g] else dropped).append(samples[g * n : (g + 1) * n])
    filled = max(0, need - len(kept))
    groups = kept[:need] + dropped[:filled]
    out = []
    for g, group in enumerate(groups):  # renumber: the trainer sees one contiguous batch
        for j, s in enumerate(group):
            s.group_index, s.index = g, g * n + j
            out.append(s)
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/groups_sampled": float(drawn // n),
        "dynamic_sampling/groups_kept": float(len(kept)),
        "dynamic_sampling/filled_without_signal": float(filled),
    }
    return out, metrics


def resolve_precision(cfg: Config) -> tuple[Config, dict]:
    """`cfg` with `rollout.dtype` and `train.dtype` resolved from the hardware (`auto`: bf16 only
    where it is native), and a record of each choice, its reason and the CPU, for config.json."""
    record: dict = {"machine": cpu_info()}
    groups = {}
    for group, name in (("rollout", "dtype"), ("train", "dtype")):
        field_name = f"{group}.{name}"
        requested = getattr(getattr(cfg, group), name)
        choice = resolve_dtype(requested, field_name)
        log.info("%s: %s (%s)", field_name, choice.dtype, choice.reason)
        record[field_name] = {"requested": requested, **choice.to_dict()}
        groups[group] = dataclasses.replace(getattr(cfg, group), **{name: choice.dtype})
    return dataclasses.replace(cfg, **groups), record


def train(cfg: Config, resume: bool = False) -> list[dict]:
    """Run `cfg.train.num_steps` steps of RL (or SFT when `algo.mode` is sft), continuing from the
    latest checkpoint when `resume`. Returns the metrics history."""
    t_cfg, r_cfg, a_cfg = cfg.train, cfg.rollout, cfg.algo
    sft = a_cfg.mode == "sft"
    if t_cfg.num_threads:
        torch.set_num_threads(t_cfg.num_threads)
    random.seed(t_cfg.seed)
    torch.manual_seed(t_cfg.seed)
    out_dir = Path(t_cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, precision = resolve_precision(cfg)
    atomic_write_json(out_dir / "config.json", {**cfg.to_dict(), "resolved": precision})
    t_cfg, r_cfg = cfg.train, cfg.rollout

    model_dir = ensure_model(t_cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if sft:
        source = DataSource(
            load_sft_data(cfg.data, tokenizer), t_cfg.global_batch_size, cfg.data.shuffle, cfg.data.seed
        )
    else:
        source = DataSource(load_data(cfg.data, tokenizer), r_cfg.rollout_batch_size, cfg.data.shuffle, cfg.data.seed)

    start, ckpt = 0, latest_checkpoint(out_dir) if resume else None
    if resume and ckpt is None:
        log.warning("resume: no checkpoint in %s, starting from step 0", out_dir / "checkpoints")
    max_len = cfg.data.max_length if sft else r_cfg.max_new_tokens
    actor = Actor(
        ckpt or model_dir, t_cfg, a_cfg, r_cfg.temperature, pad_id, reference=model_dir, max_response_len=max_len
    )
    critic = Critic(model_dir, t_cfg, a_cfg, pad_id) if a_cfg.advantage == "ppo" and not sft else None
    if ckpt is not None:
        trainer_state, state = load_checkpoint(ckpt)
        actor.load_state_dict(trainer_state)
        if critic is not None:
            critic.load_state_dict(trainer_state["critic"])
        source.load_state_dict(state["data"])
        start = state["step"]
        log.info("resumed from %s at step %d", ckpt, start)

    engine = None
    if not sft:
        engine = make_engine(r_cfg, model_dir, tokenizer, cfg.data.max_prompt_length)
        sync_weights(engine, actor, start)
        rollout = RolloutManager(engine, r_cfg)
    logger = MetricsLogger(
        cfg.log.dir or out_dir,
        tensorboard=cfg.log.tensorboard,
        console=cfg.log.console,
        resume=ckpt is not None,
        total_steps=t_cfg.num_steps,
    )
    if ckpt is not None:
        logger.truncate_after(start)

    try:
        for step in range(start, t_cfg.num_steps):
            t0 = time.perf_counter()
            if sft:
                samples = source.next_batch()
                metrics = actor.train_step(samples, None)
                metrics["time/train"] = time.perf_counter() - t0
                metrics["perf/train_tokens_per_s"] = sum(len(s.tokens) for s in samples) / metrics["time/train"]
                metrics["data/epoch"] = float(source.epoch)
            else:
                metrics = rl_step(step, source, rollout, actor, critic, engine, cfg)
            metrics["time/step"] = time.perf_counter() - t0
            logger.log(step + 1, metrics)

            done = step + 1
            if (t_cfg.save_interval and done % t_cfg.save_interval == 0) or done == t_cfg.num_steps:
                trainer_state = actor.state_dict()
                if critic is not None:
                    trainer_state["critic"] = critic.state_dict()
                save_checkpoint(
                    out_dir,
                    done,
                    actor.model,
                    tokenizer,
                    trainer_state,
                    {"data": source.state_dict(), "weight_version": done},
                )
    finally:
        logger.close()
    history = logger.history()
    if cfg.log.console and not sft:
        print_reward_table(history)
    return history


def sync_weights(engine: Engine, actor: Actor, version: int) -> None:
    """Hand the policy's weights to the engine as `version`. An engine in this process shares the
    trainer's tensors where the dtypes agree (no copy, no second copy in memory): the sync loop
    never generates while the trainer updates them."""
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        dtype = next(model.parameters()).dtype
        engine.update_weights_from_tensors(actor.named_weights(dtype), version=version, share=True)
    else:
        engine.update_weights_from_tensors(actor.named_weights(), version=version)


def rl_step(
    step: int,
    source: DataSource,
    rollout: RolloutManager,
    actor: Actor,
    critic: Critic | None,
    engine: Engine,
    cfg: Config,
) -> dict[str, float]:
    """One rollout → advantages → update → weight sync step; returns its metrics."""
    r_cfg, a_cfg = cfg.rollout, cfg.algo
    t0 = time.perf_counter()
    samples, metrics = collect(source, rollout, step, a_cfg, r_cfg.reward_key)
    t_rollout = time.perf_counter() - t0

    t1 = time.perf_counter()
    rewards = shaped_rewards(samples, a_cfg, r_cfg.reward_key, r_cfg.max_new_tokens)
    valid = torch.tensor([s.status != Status.FAILED for s in samples])
    # extra forward passes, each only when the algorithm needs it
    need_logp = a_cfg.kl_in_reward or actor.teacher is not None
    log_probs = actor.compute_log_probs(samples) if need_logp else None
    ref = actor.compute_log_probs(samples, "reference") if actor.ref is not None else None
    teacher = actor.compute_log_probs(samples, "teacher") if actor.teacher is not None else None
    values = critic.values(samples) if critic is not None else None
    adv, returns, adv_metrics = compute_advantages(
        a_cfg, samples, rewards, valid, r_cfg.n_samples_per_prompt, log_probs, ref, values, teacher
    )
    metrics.update(adv_metrics)
    metrics.update(rollout_metrics(samples, rewards, r_cfg.n_samples_per_prompt))
    if a_cfg.mask_truncated:  # DAPO overlong filtering: in the group statistics, out of the loss
        for s in samples:
            if s.status == Status.TRUNCATED:
                s.loss_mask = [0] * s.response_length
    metrics.update(actor.train_step(samples, adv, log_probs, ref))
    if critic is not None:
        metrics.update(critic.train_step(samples, returns, values))
    t_train = time.perf_counter() - t1

    t2 = time.perf_counter()
    sync_weights(engine, actor, step + 1)
    t_sync = time.perf_counter() - t2

    resp_tokens = sum(s.response_length for s in samples)
    train_tokens = sum(len(s.tokens) for s in samples)
    metrics.update(
        {
            "advantage/mean": float(adv.sum() / max(sum(s.response_length for s in samples), 1)),
            "time/rollout": t_rollout,
            "time/train": t_train,
            "time/sync": t_sync,
            "perf/rollout_tokens_per_s": resp_tokens / max(t_rollout, 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(t_train, 1e-9),
            "data/epoch": float(source.epoch),
        }
    )
    for s in samples[: cfg.log.log_samples]:
        log.info("sample (reward %.2f, %s): %r", scalar_reward(s, r_cfg.reward_key), s.status.value, s.response[:160])
    return metrics


def load_sft_data(cfg: DataConfig, tokenizer) -> list[Sample]:
    """SFT samples from `data.path` (chats or prompt/response pairs), over-long ones dropped and counted."""
    samples, dropped = load_sft_samples(
        cfg.path,
        tokenizer,
        messages_key=cfg.messages_key,
        prompt_key=cfg.input_key,
        response_key=cfg.response_key,
        max_length=cfg.max_length,
        apply_chat_template=cfg.apply_chat_template,
        system_prompt=cfg.system_prompt,
    )
    log.info(
        "data: %d sft samples from %s, %d dropped as longer than %d tokens",
        len(samples),
        cfg.path,
        dropped,
        cfg.max_length,
    )
    if not samples:
        raise ValueError(f"data.path {cfg.path}: no sft samples left after dropping {dropped} over-long ones")
    return samples


def setup_logging() -> None:
    level = os.environ.get("TIDAL_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would bury the per-step lines
