"""The synchronous RL loop, top to bottom, as a script of roles (built by `tidal.cluster`):

    trainer   compute_log_probs · train_step · save       (one process, or FSDP2 ranks on Ray)
    engines   generate (through the rollout manager) · sleep / wake when colocated
    sync      push the trainer's weights to every engine as a version (checked, bounded)

for step in steps:
    samples  = collect(data, rollout)                   # engine samples + log-probs, rewards (+ DAPO filter)
    logp/ref/teacher/values = forward passes, only those the algorithm needs
    adv      = compute_advantages(algo, ...)            # tidal.algo, pure
    metrics  = trainer.train_step(samples, adv)         # micro-batches or packing, AdamW, clip
    critic.train_step(samples, returns)                 # ppo only
    sync.push(step + 1)                                 # next rollout sees the new policy
    checkpoint every train.save_interval steps

`algo.mode: sft` runs the same trainer on chat data, with no rollout.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

import torch

from tidal.config import Config
from tidal.convert import ensure_model, load_tokenizer
from tidal.data.load import image_reader, load_sft_data, prompt_source
from tidal.data.source import DataSource
from tidal.debug_rollout import rollout_for_step
from tidal.eval import Evaluator, close_rewards
from tidal.hardware import cpu_info, memory_metrics, resolve_device, resolve_dtype
from tidal.hooks import check_user_code
from tidal.log import MetricsLogger, print_reward_table
from tidal.reward.sandbox import check_run, set_default_backend
from tidal.roles import Roles, build_roles
from tidal.rollout.collect import collect, rollout_metrics, shaped_rewards
from tidal.rollout.engine_stats import EngineCounters
from tidal.rollout.manager import RolloutManager, group_size
from tidal.rollout.overlap import OverlappedRollout
from tidal.run_dir import RunFolder, check_run_dir
from tidal.samples_log import record_step
from tidal.tracking import open_tracker
from tidal.train.checkpoint import load_checkpoint, save_checkpoint
from tidal.train.estimate import NoSignalWarnings, compute_advantages, zero_advantage_reason
from tidal.types import Status

log = logging.getLogger("tidal")


def resolve_precision(cfg: Config) -> tuple[Config, dict]:
    """`cfg` with `cluster.device` resolved (`auto`: cuda where torch sees a GPU) and then
    `engine.dtype` and `train.dtype` for that device (`auto`: bf16 only where it is native), and
    a record of each choice, its reason and the CPU, for config.json. On Ray each worker resolves
    `auto` on its own machine, so `cfg` keeps it."""
    record: dict = {"machine": cpu_info()}
    requested = cfg.cluster.device
    if cfg.uses_ray and requested == "auto":
        record["cluster.device"] = {"requested": requested, "device": "auto", "reason": "resolved by each Ray worker"}
        device = resolve_device(requested).device  # this node's, for the dtypes resolved here
    else:
        choice = resolve_device(requested)
        log.info("cluster.device: %s (%s)", choice.device, choice.reason)
        record["cluster.device"] = {"requested": requested, **choice.to_dict()}
        device = choice.device
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device=device))
    groups = {}
    for group, name in (("engine", "dtype"), ("train", "dtype")):
        field_name = f"{group}.{name}"
        requested = getattr(getattr(cfg, group), name)
        choice = resolve_dtype(requested, field_name, device)
        if cfg.uses_ray and requested == "auto":
            record[field_name] = {"requested": requested, "dtype": "auto", "reason": "resolved by each Ray worker"}
            continue
        log.info("%s: %s (%s)", field_name, choice.dtype, choice.reason)
        record[field_name] = {"requested": requested, **choice.to_dict()}
        groups[group] = dataclasses.replace(getattr(cfg, group), **{name: choice.dtype})
    if cfg.engine.quantization != "none" and cfg.algo.is_correction == "none":
        log.warning(
            "engine.quantization %s samples from a rounded copy of the policy and algo.is_correction is none: "
            "the trainer treats those tokens as its own (set algo.is_correction: truncate or mask)",
            cfg.engine.quantization,
        )
    return dataclasses.replace(cfg, **groups), record


def train(cfg: Config, resume: bool = False, allow_config_change: bool = False) -> list[dict]:
    """Run `cfg.train.num_steps` steps of RL (or SFT when `algo.mode` is sft), continuing from the
    newest complete checkpoint when `resume` (see `tidal.run_dir` for what a resume may change).
    Returns the metrics history."""
    t_cfg, sft = cfg.train, cfg.algo.mode == "sft"
    if cfg.sandbox.backend is not None:  # the code sandbox of rewards and tools, here and in workers
        set_default_backend(cfg.sandbox.backend)
    check_run(cfg.runs_model_code, cfg.sandbox.backend)  # bubblewrap usable where model-written code runs
    check_user_code(cfg)  # the rewards, generate functions, filters...: before any model, and the folder untouched
    if t_cfg.num_threads:
        torch.set_num_threads(t_cfg.num_threads)
    random.seed(t_cfg.seed)
    torch.manual_seed(t_cfg.seed)
    out_dir = Path(t_cfg.output_dir)
    with RunFolder(out_dir) as folder:  # this run's alone; a start that fails leaves it as it was
        cfg, precision = resolve_precision(cfg)
        ckpt = check_run_dir(cfg, resume, allow_config_change)

        model_dir = ensure_model(t_cfg.model)
        tokenizer = load_tokenizer(model_dir)
        images = None
        if sft:
            source = DataSource(
                load_sft_data(cfg.data, tokenizer), t_cfg.global_batch_size, cfg.data.shuffle, cfg.data.seed
            )
        else:
            images = image_reader(cfg.data, model_dir)  # a vision-language model's
            source = prompt_source(cfg.data, tokenizer, cfg.rollout.rollout_batch_size, images)
        start, state = 0, {}

        roles = build_roles(cfg, model_dir, tokenizer, ckpt, sft)
        try:
            log.info("%s", roles.trainer.describe())  # full or LoRA, parameters trained, precision, device
            if ckpt is not None:
                trainer_state, state = load_checkpoint(ckpt)
                roles.trainer.load_state_dict(trainer_state)
                if roles.critic is not None:
                    roles.critic.load_state_dict(trainer_state["critic"])
                source.load_state_dict(state["data"])
                start = state["step"]
                log.info("resumed from %s at step %d", ckpt, start)
            overlapped = None
            if not sft:
                roles.sync.push(start)  # the engines answer and take the weights (their key, their limits)
                rollout = RolloutManager.from_config(roles.engines.engine, cfg, tokenizer, roles.engines.loop, images)
                # the reward's own resources (a local judge's server and engine, worker processes)
                # end with the run; closers run in reverse, so after the overlapped worker stops
                roles.closers.append(lambda: close_rewards(rollout))
                if cfg.overlap.mode != "off":  # a worker thread rolls out ahead while the trainer trains
                    overlapped = OverlappedRollout(
                        cfg.overlap, cfg.algo, t_cfg.num_steps, source, rollout, start, state.get("overlap")
                    )
                    roles.closers.append(overlapped.close)
                evaluator = Evaluator(cfg, tokenizer, roles.engines.engine, roles.engines.loop, model_dir)
            folder.start({**cfg.to_dict(), "resolved": precision})  # every check passed: the folder is this run's
            logger = MetricsLogger(
                cfg.log.dir or out_dir,
                tensorboard=cfg.log.tensorboard,
                console=cfg.log.console,
                resume=ckpt is not None,
                total_steps=t_cfg.num_steps,
                tracker=open_tracker(cfg.log, cfg.log.dir or out_dir, cfg.to_dict(), resume=ckpt is not None),
            )
            if ckpt is not None:
                logger.truncate_after(start)
            no_signal = NoSignalWarnings()
            try:
                if not sft and start == 0 and evaluator.due(0):  # the initial weights' row, step 0
                    logger.log(0, evaluator.run(0, overlapped))
                counters = None if sft else EngineCounters(roles.engines)  # engine/*: each step's work
                for step in range(start, t_cfg.num_steps):
                    t0 = time.perf_counter()
                    if sft:
                        metrics = sft_step(source, roles)
                    else:
                        metrics = rl_step(step, source, rollout, roles, cfg, overlapped, no_signal)
                    metrics["time/step"] = time.perf_counter() - t0
                    if counters is not None:
                        metrics.update(counters.read())
                    if not cfg.uses_ray:  # the trainer and engine of this process (CUDA only)
                        metrics.update(memory_metrics(cfg.cluster.device))
                    if not sft and evaluator.due(step + 1):  # the weights this step produced
                        metrics.update(evaluator.run(step + 1, overlapped))
                        counters.skip()  # the evaluation's tokens are not the next step's
                    logger.log(step + 1, metrics)
                    done = step + 1
                    if cfg.debug.rollout_only:  # nothing trained, nothing to save
                        continue
                    if (t_cfg.save_interval and done % t_cfg.save_interval == 0) or done == t_cfg.num_steps:
                        # a vision-language model's checkpoints carry its processor (tokenizer within)
                        files = images.processor if images is not None else tokenizer
                        save(done, cfg, roles, source, files, overlapped)
            finally:
                logger.close()
        finally:
            roles.close()
    history = logger.history()
    if cfg.log.console and not sft:
        print_reward_table(history)
    return history


def save(done: int, cfg: Config, roles: Roles, source, tokenizer, overlapped: OverlappedRollout | None) -> None:
    """Checkpoint after step `done`: trainer (and critic), data position, the overlapped buffer, and
    beside the weights `tokenizer` (anything with `save_pretrained`: a vision-language model's processor)."""
    trainer_state = roles.trainer.state_dict()
    if roles.critic is not None:
        trainer_state["critic"] = roles.critic.state_dict()
    if overlapped is not None:  # the worker finishes its wave: buffer and source agree
        overlapped.pause()
    try:
        state = {"data": source.state_dict(), "weight_version": done}
        if overlapped is not None:
            state["overlap"] = overlapped.state_dict()
        t = cfg.train
        write_model = roles.trainer.save_model
        save_checkpoint(t.output_dir, done, write_model, tokenizer, trainer_state, state, t.keep_checkpoints)
    finally:
        if overlapped is not None:
            overlapped.resume()


def sft_step(source: DataSource, roles: Roles) -> dict[str, float]:
    t0 = time.perf_counter()
    samples = source.next_batch()
    metrics = roles.trainer.train_step(samples, None)
    metrics["time/train"] = time.perf_counter() - t0
    metrics["perf/train_tokens_per_s"] = sum(len(s.tokens) for s in samples) / metrics["time/train"]
    metrics["data/epoch"] = float(source.epoch)
    return metrics


def rl_step(
    step: int,
    source: DataSource,
    rollout: RolloutManager,
    roles: Roles,
    cfg: Config,
    overlapped: OverlappedRollout | None = None,
    no_signal: NoSignalWarnings | None = None,
) -> dict[str, float]:
    """One rollout → advantages → update → weight sync step; returns its metrics. `no_signal`
    warns (rate-limited, across steps) when a step has no advantage to train on."""
    no_signal = no_signal if no_signal is not None else NoSignalWarnings()
    r_cfg, a_cfg, trainer, critic = cfg.rollout, cfg.algo, roles.trainer, roles.critic
    t0 = time.perf_counter()
    if overlapped is not None:  # rolled out while earlier steps trained
        samples, metrics = overlapped.next_batch(step)
    else:
        samples, metrics = rollout_for_step(
            cfg.debug, step + 1, lambda: collect(source, rollout, step, a_cfg, cfg.reward.key)
        )
    t_rollout = time.perf_counter() - t0
    if cfg.debug.rollout_only:  # no forward pass, update or sync: the weights stay as loaded
        rewards = shaped_rewards(samples, a_cfg, cfg.reward.key, r_cfg.response_budget)
        _keep_samples(cfg, step, samples, rewards, None)
        return {**metrics, **rollout_metrics(samples, rewards, group_size(samples)), "time/rollout": t_rollout}
    if roles.colocate:  # the engines give their memory to the trainers until the next push
        roles.engines.sleep()
    elif overlapped is None:  # the engines are idle until the push
        roles.sync.before_train()

    t1 = time.perf_counter()
    rewards = shaped_rewards(samples, a_cfg, cfg.reward.key, r_cfg.response_budget)
    # n_samples_per_prompt times a generate function's fan-out: an int, or each group's size when
    # the fan-out differs from prompt to prompt (ragged groups; every estimator takes either)
    group = group_size(samples)
    valid = torch.tensor([s.status != Status.FAILED for s in samples])
    # extra forward passes, each only when the algorithm needs it
    need_logp = a_cfg.kl_in_reward or trainer.has_teacher
    log_probs = trainer.compute_log_probs(samples) if need_logp else None
    ref = trainer.compute_log_probs(samples, "reference") if trainer.has_reference else None
    teacher = trainer.compute_log_probs(samples, "teacher") if trainer.has_teacher else None
    values = critic.values(samples) if critic is not None else None
    adv, returns, adv_metrics = compute_advantages(
        a_cfg, samples, rewards, valid, group, log_probs, ref, values, teacher
    )
    metrics.update(adv_metrics)
    metrics.update(rollout_metrics(samples, rewards, group))
    if a_cfg.mask_truncated:  # DAPO overlong filtering: in the group statistics, out of the loss
        for s in samples:
            if s.status == Status.TRUNCATED:
                s.loss_mask = [0] * s.response_length
    no_signal.check(step + 1, zero_advantage_reason(a_cfg, samples, rewards, valid, group, adv))
    metrics.update(trainer.train_step(samples, adv, log_probs, ref))
    if critic is not None:
        metrics.update(critic.train_step(samples, returns, values))
    t_train = time.perf_counter() - t1

    t2 = time.perf_counter()
    if roles.colocate:
        roles.engines.wake()
    if overlapped is None:
        metrics.update(roles.sync.push(step + 1))
    elif (step + 1) % cfg.overlap.sync_interval == 0:  # at a point the rollout makes safe for it
        metrics.update(overlapped.push(step + 1, roles.sync.push))
        metrics["time/trainer_idle"] = metrics.get("time/trainer_idle", 0.0) + metrics.pop("time/push_wait")
    t_sync = time.perf_counter() - t2

    resp_tokens = sum(s.response_length for s in samples)
    metrics.update(
        {
            "advantage/mean": float(adv.sum() / max(resp_tokens, 1)),
            "time/rollout": t_rollout,
            "time/train": t_train,
            "time/sync": t_sync,
            # in the synchronous loop each side waits while the other works
            "time/trainer_idle": metrics.get("time/trainer_idle", t_rollout),
            "time/engine_idle": metrics.get("time/engine_idle", t_train + t_sync),
            "perf/rollout_tokens_per_s": resp_tokens / max(t_rollout, 1e-9),
            "perf/train_tokens_per_s": sum(len(s.tokens) for s in samples) / max(t_train, 1e-9),
            "data/epoch": float(source.epoch),
        }
    )
    _keep_samples(cfg, step, samples, rewards, adv)
    return metrics


def _keep_samples(cfg: Config, step: int, samples, rewards, adv) -> None:
    """The step's samples to output_dir/samples (always in rollout-only mode) and a few to the log."""
    save = cfg.log.save_samples or cfg.debug.rollout_only
    run_dir = cfg.log.dir or cfg.train.output_dir
    record_step(
        run_dir, step + 1, samples, rewards, adv, reward_key=cfg.reward.key, show=cfg.log.log_samples, save=save
    )
