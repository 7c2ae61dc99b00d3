"""The synchronous RL loop, top to bottom: rollout → rewards → advantages → train → weight sync.

for step in steps:
    prompts  = data.next_batch()
    samples  = rollout.generate(prompts)          # engine samples + log-probs, rewards
    adv      = grpo_advantages(rewards, group)    # tidal.algo, pure
    metrics  = actor.train_step(samples, adv)     # micro-batches, AdamW, clip
    engine.update_weights(actor.weights, step+1)  # next rollout sees the new policy
    checkpoint every train.save_interval steps
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tidal.algo import grpo_advantages
from tidal.config import Config, DataConfig
from tidal.convert import ensure_model
from tidal.data.dataset import PromptRecord, build_prompts, load_prompts
from tidal.data.envs import make_env_rows
from tidal.data.source import DataSource
from tidal.engine.hf_engine import HFEngine
from tidal.log import MetricsLogger, print_reward_table
from tidal.rollout.manager import RolloutManager
from tidal.rollout.rewards import scalar_reward
from tidal.train.actor import Actor
from tidal.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
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


def train(cfg: Config, resume: bool = False) -> list[dict]:
    """Run `cfg.train.num_steps` GRPO steps (continuing from the latest checkpoint when `resume`).
    Returns the metrics history."""
    t_cfg, r_cfg = cfg.train, cfg.rollout
    if t_cfg.num_threads:
        torch.set_num_threads(t_cfg.num_threads)
    random.seed(t_cfg.seed)
    torch.manual_seed(t_cfg.seed)
    out_dir = Path(t_cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "config.json", cfg.to_dict())

    model_dir = ensure_model(t_cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    source = DataSource(load_data(cfg.data, tokenizer), r_cfg.rollout_batch_size, cfg.data.shuffle, cfg.data.seed)

    start, ckpt = 0, latest_checkpoint(out_dir) if resume else None
    if resume and ckpt is None:
        log.warning("resume: no checkpoint in %s, starting from step 0", out_dir / "checkpoints")
    actor = Actor(ckpt or model_dir, t_cfg, cfg.algo, r_cfg.temperature, pad_id, reference=model_dir)
    if ckpt is not None:
        trainer_state, state = load_checkpoint(ckpt)
        actor.load_state_dict(trainer_state)
        source.load_state_dict(state["data"])
        start = state["step"]
        log.info("resumed from %s at step %d", ckpt, start)

    engine = HFEngine(model_dir, tokenizer, dtype=r_cfg.dtype)
    engine.update_weights_from_tensors(actor.named_weights(), version=start)
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
    group = r_cfg.n_samples_per_prompt

    try:
        for step in range(start, t_cfg.num_steps):
            t0 = time.perf_counter()
            samples = rollout.generate(source.next_batch(), step)
            t_rollout = time.perf_counter() - t0

            rewards = torch.tensor([scalar_reward(s, r_cfg.reward_key) for s in samples], dtype=torch.float32)
            valid = torch.tensor([s.status != Status.FAILED for s in samples])
            adv = grpo_advantages(rewards, group, std_normalize=cfg.algo.advantage == "grpo", valid=valid)

            t1 = time.perf_counter()
            metrics = actor.train_step(samples, adv)
            t_train = time.perf_counter() - t1

            t2 = time.perf_counter()
            engine.update_weights_from_tensors(actor.named_weights(), version=step + 1)
            t_sync = time.perf_counter() - t2

            resp_tokens = sum(s.response_length for s in samples)
            train_tokens = sum(len(s.tokens) for s in samples)
            metrics.update(rollout_metrics(samples, rewards, group))
            metrics.update(
                {
                    "time/rollout": t_rollout,
                    "time/train": t_train,
                    "time/sync": t_sync,
                    "time/step": time.perf_counter() - t0,
                    "perf/rollout_tokens_per_s": resp_tokens / max(t_rollout, 1e-9),
                    "perf/train_tokens_per_s": train_tokens / max(t_train, 1e-9),
                    "data/epoch": float(source.epoch),
                }
            )
            logger.log(step + 1, metrics)
            for s in samples[: cfg.log.log_samples]:
                log.info(
                    "sample (reward %.2f, %s): %r", scalar_reward(s, r_cfg.reward_key), s.status.value, s.response[:160]
                )

            done = step + 1
            if (t_cfg.save_interval and done % t_cfg.save_interval == 0) or done == t_cfg.num_steps:
                save_checkpoint(
                    out_dir,
                    done,
                    actor.model,
                    tokenizer,
                    actor.state_dict(),
                    {"data": source.state_dict(), "weight_version": done},
                )
    finally:
        logger.close()
    history = logger.history()
    if cfg.log.console:
        print_reward_table(history)
    return history


def setup_logging() -> None:
    level = os.environ.get("TIDAL_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would bury the per-step lines
