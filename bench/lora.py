"""Full fine-tuning vs LoRA on the quickstart workload: peak memory, train step time, sync bytes.

    python -m bench lora                        # 1 warm-up + 4 measured steps per arm
    python -m bench lora --steps 6 --rank 8

Workload: `examples/quickstart/config.yaml` (SmolLM2-135M-Instruct, 8 prompts x 4 samples of at
most 48 tokens, micro-batches of 8, 2 torch threads, dtype as tidal resolves it for this CPU)
against `examples/lora/config.yaml` (the same with rank-16 LoRA and its lr), both with the KL
on (`algo.kl_coef`, default 0.01): the full arm loads its reference model, LoRA scores the
reference with its adapters off. Each arm runs in its own subprocess, built as `tidal.loop.train` builds a run
(`build_roles`: trainer, in-process engine, in-process weight sync), and then:

- rolls out one batch with the engine (both arms start from the same weights and seeds, so the
  batch is the same; its token count is recorded to show it);
- takes `--warmup` + `--steps` GRPO steps on that batch, each as `rl_step` does it after the
  rollout: reference log-probs, advantages, `train_step` (forward, backward, AdamW), then a
  weight push to the engine. The same batch every step keeps the comparison about the trainer,
  not about how long the two policies' responses grow;
- reports the median step time (reference + advantages + train) and push time over the measured
  steps, `sync/bytes` of the first push (when the loop starts) and of a push after a step, and
  the process's peak RSS (`ru_maxrss`), the RSS and the peak once everything is built (before
  any step) and the most RSS seen after each phase of a step (reference, train, push).

Without LoRA the engine shares the trainer's fp32 tensors in place (`InProcessSync(share=True)`),
so after the first push nothing new crosses; with LoRA (`lora`) every push hands over freshly
merged matrices (W + s·B·A) of the targeted layers, which the engine holds beside the trainer's
W; `lora_unmerged` (`train.lora_merge: false`) has the engine run the trainer's own LoRA layers
on shared tensors: no merged copy, nothing to push, a slower rollout (its time is recorded).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import machine, peak_rss_mb, run_measurement, write_result

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples/quickstart/config.yaml"
LORA = ROOT / "examples/lora/config.yaml"


def rss_mb() -> float:
    """The current resident memory of this process (VmRSS, KiB on Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def commit() -> str:
    """The checkout's commit, with `+dirty` when tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "tidal"], cwd=ROOT).returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "")


def child(args) -> None:
    """One arm in this process; prints `RESULT {json}`."""
    import torch

    from tidal.config import build_config
    from tidal.convert import ensure_model, load_tokenizer
    from tidal.data.load import prompt_source
    from tidal.loop import resolve_precision
    from tidal.roles import build_roles
    from tidal.rollout.collect import collect, shaped_rewards
    from tidal.rollout.manager import RolloutManager, group_size
    from tidal.train.estimate import compute_advantages
    from tidal.types import Status

    # nothing is written there: the bench builds the roles, not a run folder
    overrides = {"algo.kl_coef": args.kl_coef, "train.output_dir": "/tmp/bench-lora-unused"}
    if args.arm.startswith("lora") and args.rank:
        overrides["train.lora_rank"] = args.rank
    if args.arm == "lora_unmerged":  # the engine runs the trainer's own LoRA layers (train.lora_merge false)
        overrides["train.lora_merge"] = False
    config = LORA if args.arm.startswith("lora") else QUICKSTART
    cfg, precision = resolve_precision(build_config(str(config), overrides))
    torch.set_num_threads(cfg.train.num_threads)
    torch.manual_seed(cfg.train.seed)
    model_dir = ensure_model(cfg.train.model)
    tokenizer = load_tokenizer(model_dir)
    source = prompt_source(cfg.data, tokenizer, cfg.rollout.rollout_batch_size)

    roles = build_roles(cfg, model_dir, tokenizer, None)
    try:
        trainer, a_cfg = roles.trainer, cfg.algo
        first_push = roles.sync.push(0)  # what the loop does before its first rollout
        rollout = RolloutManager.from_config(roles.engines.engine, cfg, tokenizer, roles.engines.loop)
        t_roll = time.perf_counter()
        batch, _ = collect(source, rollout, 0, a_cfg, cfg.reward.key)
        rollout_s = time.perf_counter() - t_roll
        rss_built, peak_built = rss_mb(), peak_rss_mb()

        steps, pushes = [], []
        rss_after = {"reference": 0.0, "train": 0.0, "push": 0.0}  # the most resident after each phase
        for i in range(args.warmup + args.steps):
            samples = copy.deepcopy(batch)  # the trainer may mark samples; every step starts alike
            t0 = time.perf_counter()
            rewards = shaped_rewards(samples, a_cfg, cfg.reward.key, cfg.rollout.response_budget)
            valid = torch.tensor([s.status != Status.FAILED for s in samples])
            ref = trainer.compute_log_probs(samples, "reference")
            rss_after["reference"] = max(rss_after["reference"], rss_mb())
            adv, _, _ = compute_advantages(a_cfg, samples, rewards, valid, group_size(samples), None, ref, None, None)
            metrics = trainer.train_step(samples, adv, None, ref)
            t1 = time.perf_counter()
            rss_after["train"] = max(rss_after["train"], rss_mb())
            push = roles.sync.push(i + 1)
            t2 = time.perf_counter()
            rss_after["push"] = max(rss_after["push"], rss_mb())
            if i >= args.warmup:
                steps.append(t1 - t0)
                pushes.append({"seconds": t2 - t1, **push})
            print(f"  {args.arm} step {i + 1}: {t1 - t0:.2f} s train, {push['sync/bytes'] / 1e6:.0f} MB pushed")
        model = trainer.trained.master
        result = {
            "arm": args.arm,
            "rollout_s": rollout_s,  # the one rollout (its length differs if the arms sample differently)
            "train_step_s_median": statistics.median(steps),
            "train_step_s": steps,
            "push_s_median": statistics.median(p["seconds"] for p in pushes),
            "sync_bytes_first_push": first_push["sync/bytes"],
            "sync_bytes_step_push": pushes[-1]["sync/bytes"],
            "sync_tensors_step_push": pushes[-1]["sync/tensors"],
            "peak_rss_mb": peak_rss_mb(),
            "rss_built_mb": rss_built,
            "peak_rss_built_mb": peak_built,
            "rss_after_mb": rss_after,
            "has_reference_model": trainer.ref is not None,
            "params": sum(p.numel() for p in model.parameters()),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "optimizer_state_mb": sum(
                t.numel() * t.element_size()
                for s in trainer.optimizer.state.values()
                for t in s.values()
                if torch.is_tensor(t)
            )
            / 1e6,
            "batch_tokens": sum(len(s.tokens) for s in batch),
            "batch_response_tokens": sum(s.response_length for s in batch),
            "kl_last": metrics.get("loss/kl"),
            "dtype": cfg.train.dtype,
            "threads": torch.get_num_threads(),
            "lora_rank": cfg.train.lora_rank,
            "lr": cfg.train.lr,
            "precision": precision,
        }
    finally:
        roles.close()
    print("RESULT " + json.dumps(result))


def print_table(by: dict[str, dict]) -> None:
    print(
        f"\n{'arm':<14}{'peak RSS MB':>12}{'built MB':>9}{'after train':>12}{'opt state MB':>13}{'trainable':>12}"
        f"{'step s':>8}{'push s':>8}{'sync MB 1st':>12}{'sync MB/step':>13}{'rollout s':>10}"
    )
    for name, r in by.items():
        print(
            f"{name:<14}{r['peak_rss_mb']:>12.0f}{r['rss_built_mb']:>9.0f}{r['rss_after_mb']['train']:>12.0f}"
            f"{r['optimizer_state_mb']:>13.0f}"
            f"{r['trainable_params']:>12,}{r['train_step_s_median']:>8.2f}{r['push_s_median']:>8.2f}"
            f"{r['sync_bytes_first_push'] / 1e6:>12.0f}{r['sync_bytes_step_push'] / 1e6:>13.0f}"
            f"{r.get('rollout_s', float('nan')):>10.1f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description="full fine-tuning vs LoRA: peak RSS, step time, sync bytes")
    p.add_argument("--steps", type=int, default=4, help="measured steps per arm")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--kl-coef", type=float, default=0.01, help="algo.kl_coef (> 0: the reference is used)")
    p.add_argument("--rank", type=int, default=0, help="LoRA rank (0: examples/lora/config.yaml's)")
    arms = ["full", "lora", "lora_unmerged"]
    p.add_argument("--arms", nargs="+", default=arms, choices=arms)
    p.add_argument("--arm", help=argparse.SUPPRESS)  # set in the child process
    args = p.parse_args()
    if args.arm:
        child(args)
        return
    if args.kl_coef <= 0:
        sys.exit("--kl-coef must be > 0: the comparison is about the reference model")

    by = {}
    started = commit()  # the same code in both arms: checked again at the end
    for arm in args.arms:
        cmd = [sys.executable, "-m", "bench", "lora", "--arm", arm, "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup), "--kl-coef", str(args.kl_coef), "--rank", str(args.rank)]
        by[arm] = run_measurement(cmd, f"arm {arm}")
        print(f"{arm}: {by[arm]['train_step_s_median']:.2f} s/step, peak RSS {by[arm]['peak_rss_mb']:.0f} MB")
    print_table(by)
    comparison = None
    if "full" in by:
        full, comparison = by["full"], {}
        for name in [a for a in by if a != "full"]:
            r = by[name]
            comparison[name] = {
                "peak_rss_saved_mb": full["peak_rss_mb"] - r["peak_rss_mb"],
                "step_time_over_full": r["train_step_s_median"] / full["train_step_s_median"],
                "rollout_time_over_full": r["rollout_s"] / full["rollout_s"],
                "same_batch": full["batch_tokens"] == r["batch_tokens"],
            }
            c = comparison[name]
            print(
                f"{name} saves {c['peak_rss_saved_mb']:.0f} MB of peak RSS; step time / full "
                f"{c['step_time_over_full']:.2f}; rollout time / full {c['rollout_time_over_full']:.2f}; "
                f"same rollout batch: {c['same_batch']}"
            )
    settings = {
        "steps": args.steps,
        "warmup": args.warmup,
        "kl_coef": args.kl_coef,
        "configs": {"full": str(QUICKSTART.relative_to(ROOT)), "lora": str(LORA.relative_to(ROOT))},
        "commit": started if commit() == started else f"{started} then {commit()}",
    }
    payload = {"machine": machine(), "settings": settings, "results": by, "comparison": comparison}
    print(f"wrote {write_result('lora', payload)}")


if __name__ == "__main__":
    main()
