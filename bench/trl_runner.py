"""The quickstart GRPO workload run by tidal and by TRL's `GRPOTrainer`, one framework per process.

Shared by `bench.grpo_step` (seconds per step) and `bench.learning` (reward curves). The parent
calls `run_child`, which starts

    python -m bench.trl_runner --framework {tidal|trl} --steps N --warmup W ...

and reads back one `RESULT {json}` line: per-step records (the first W are warm-up) plus the
process's peak RSS. The workload comes from `examples/quickstart/config.yaml`: SmolLM2-135M-Instruct
(the folder `tidal.convert.ensure_model("smollm2")` converts), `env:arithmetic` level-1 prompts
through the chat template, the `math` reward, GRPO with group-normalised advantages, no KL.

Both frameworks see the same prompts in the same order: tidal's `DataSource` (shuffled with
`data.seed`) decides the order and TRL gets those prompts as a conversational `datasets.Dataset`
with `shuffle_dataset=False`. TRL is mapped onto the same batch shape:

    tidal rollout.rollout_batch_size x rollout.n_samples_per_prompt = train.global_batch_size
    TRL   per_device_train_batch_size = train.micro_batch_size       (completions per fwd/bwd)
          gradient_accumulation_steps = global_batch_size / micro_batch_size
          steps_per_generation        = gradient_accumulation_steps (TRL's default: one generation per
                                        optimizer step, so generation_batch_size = global_batch_size)
          num_generations = n_samples_per_prompt, num_iterations = 1, beta = 0, loss_type = "dapo"
          (token mean over the whole optimizer batch, as tidal's token_mean), scale_rewards = "group",
          epsilon = 0.2, max_grad_norm = 1, constant lr, no gradient checkpointing

Each step record holds: `seconds` (wall time of the step), `rollout_s` (generate + score),
`generate_s` (sampling alone, TRL only; tidal's rollout is its generation plus a negligible reward
call), `train_s` (advantages + forward/backward + optimizer), `other_s` (the rest: tidal's weight
sync and bookkeeping, TRL's data loading and logging between steps), `completion_tokens`,
`train_tokens` (prompt + completion tokens, no padding) and `reward_mean`; tidal's also `engine`,
its engine's `engine/*` metrics of the step (docs/metrics.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from bench.common import run_measurement

# the environment the bench was started with, before anything here imports tidal (whose import
# adds its allocator settings, `tidal.ALLOCATOR_ENV`, to the process's environment)
START_ENV = dict(os.environ)

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart" / "config.yaml"
FRAMEWORKS = ("tidal", "trl")
# tidal with engine.batch_invariant and train.batch_invariant: chosen by name, never by default
VARIANTS = {"tidal_invariant": ("tidal", {"batch_invariant": 1})}


@dataclass
class Workload:
    """The knobs both frameworks share; defaults are the quickstart config's."""

    prompts: int = 8
    samples: int = 4
    max_new_tokens: int = 48
    micro_batch: int = 8
    lr: float = 1e-5
    temperature: float = 1.0
    seed: int = 0
    threads: int = 2
    # auto: each side in the best dtype the machine computes natively (bf16 only with AVX512-BF16/AMX)
    trl_dtype: str = "auto"  # bfloat16 = TRL's bf16=True (autocast over fp32 weights) | float32
    tidal_dtype: str = "auto"  # train.dtype; autocast is TRL's bf16=True precision recipe
    rollout_dtype: str = "auto"  # tidal's engine.dtype
    # where both frameworks compute: cpu (the quickstart's way) | cuda (tidal's cluster.device, TRL's
    # use_cpu=False); `auto` dtypes then resolve for that device (bf16 on a GPU that computes it)
    device: str = "cpu"
    pack_weights: int = 1  # tidal's engine.pack_weights: 1 on (the default), 0 off (`bench.memory`)
    # tidal's train.gradient_checkpointing: false (the default) | full | selective (TRL's stays off:
    # `bench.memory`)
    gradient_checkpointing: str = "false"
    # 1: tidal's engine.batch_invariant and train.batch_invariant (exact on-policy log-probs, CPU)
    batch_invariant: int = 0

    def tidal_overrides(self, steps: int, out_dir: str) -> dict:
        """Command-line style overrides of the quickstart config for this workload."""
        # the CPU runs keep the quickstart's cluster.device as it is
        device = {} if self.device == "cpu" else {"cluster.device": self.device}
        return {
            **device,
            "rollout.rollout_batch_size": self.prompts,
            "rollout.n_samples_per_prompt": self.samples,
            "rollout.max_new_tokens": self.max_new_tokens,
            "sampling.temperature": self.temperature,
            "sampling.seed": self.seed,
            "train.global_batch_size": self.prompts * self.samples,
            "train.micro_batch_size": self.micro_batch,
            "train.lr": self.lr,
            "train.dtype": self.tidal_dtype,
            "engine.dtype": self.rollout_dtype,
            "engine.pack_weights": bool(self.pack_weights),
            "engine.batch_invariant": bool(self.batch_invariant),
            "train.batch_invariant": bool(self.batch_invariant),
            "train.gradient_checkpointing": False
            if self.gradient_checkpointing == "false"
            else self.gradient_checkpointing,
            "train.seed": self.seed,
            "train.num_threads": self.threads,
            "train.num_steps": steps,
            "train.output_dir": out_dir,
            "train.save_interval": 0,
            "log.tensorboard": False,
            "log.console": False,
            "log.log_samples": 0,
        }


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """One option per `Workload` field (defaults: the quickstart config)."""
    for f in fields(Workload):
        default = getattr(Workload, f.name)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)


def workload_from_args(args: argparse.Namespace) -> Workload:
    return Workload(**{f.name: getattr(args, f.name) for f in fields(Workload)})


# -- tidal ----------------------------------------------------------------------------------------


def _tidal_config(w: Workload, steps: int, out_dir: str):
    from tidal.config import build_config

    return build_config(str(QUICKSTART), w.tidal_overrides(steps, out_dir))


def _tidal_record(m: dict) -> dict:
    rollout, train, step = m["time/rollout"], m["time/train"], m["time/step"]
    return {
        "seconds": step,
        "rollout_s": rollout,
        "generate_s": rollout,
        "train_s": train,
        "other_s": step - rollout - train,
        "completion_tokens": round(m["perf/rollout_tokens_per_s"] * rollout),
        "train_tokens": round(m["perf/train_tokens_per_s"] * train),
        "reward_mean": m["reward/mean"],
        "response_len_mean": m["response/length_mean"],
        # what the engine did: prefill and decode tokens, prefix-cache savings, preemptions, decode
        # steps overlapped and CUDA graph capture time (a capture after the first step: a fault)
        "engine": {k.removeprefix("engine/"): v for k, v in m.items() if k.startswith("engine/")},
    }


def run_tidal(w: Workload, steps: int) -> tuple[list[dict], dict]:
    """`steps` steps of `tidal.loop.train` on the workload: one record per step, and what ran."""
    from tidal.loop import train

    with tempfile.TemporaryDirectory(prefix="bench-tidal-") as tmp:
        cfg = _tidal_config(w, steps, tmp)
        history = train(cfg)
        resolved = json.loads((Path(tmp) / "config.json").read_text())["resolved"]
    info = {
        "engine": cfg.engine.kind,
        "rollout_dtype": resolved["engine.dtype"]["dtype"],
        "train_dtype": resolved["train.dtype"]["dtype"],
    }
    return [_tidal_record(m) for m in history], info


# -- TRL ------------------------------------------------------------------------------------------


def tidal_prompt_order(w: Workload, steps: int, tokenizer) -> list:
    """The PromptRecords tidal's data source hands out over `steps` steps, in order."""
    from tidal.data.load import load_data
    from tidal.data.source import DataSource

    cfg = _tidal_config(w, steps, tempfile.gettempdir())
    source = DataSource(load_data(cfg.data, tokenizer), w.prompts, cfg.data.shuffle, cfg.data.seed)
    return [r for _ in range(steps) for r in source.next_batch()]


def _trl_dataset(records):
    """A conversational dataset: TRL applies the tokenizer's chat template, as tidal does."""
    from datasets import Dataset

    rows = []
    for r in records:
        if not isinstance(r.prompt, str):
            raise ValueError("the bench expects plain-text prompts")
        rows.append({"prompt": [{"role": "user", "content": r.prompt}], "label": r.label})
    return Dataset.from_list(rows)


def math_reward(completions, label, **kwargs) -> list[float]:
    """tidal's `math` reward (1.0 when the completion's final answer equals the label) for TRL."""
    from tidal.reward.verifiers import math_verify

    return [math_verify(c[-1]["content"], y) for c, y in zip(completions, label, strict=True)]


def trl_dtype(w: Workload) -> str:
    """TRL's precision: `auto` is bf16 autocast where the device (the CPU, or the GPU with
    `device: cuda`) computes bf16 natively, else fp32."""
    from tidal.hardware import resolve_dtype

    return resolve_dtype(w.trl_dtype, "trl dtype", w.device).dtype


def trl_config(w: Workload, steps: int, out_dir: str):
    """GRPOConfig with the workload's batch shape (see the module docstring)."""
    from trl import GRPOConfig

    per_step = w.prompts * w.samples
    if per_step % w.micro_batch:
        raise ValueError(f"prompts x samples ({per_step}) must be a multiple of micro_batch ({w.micro_batch})")
    return GRPOConfig(
        output_dir=out_dir,
        use_cpu=w.device == "cpu",
        bf16=trl_dtype(w) == "bfloat16",
        model_init_kwargs={"dtype": "float32"},  # fp32 master weights, like tidal
        per_device_train_batch_size=w.micro_batch,
        gradient_accumulation_steps=per_step // w.micro_batch,
        num_generations=w.samples,
        num_iterations=1,
        max_completion_length=w.max_new_tokens,
        temperature=w.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=w.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        gradient_checkpointing=False,
        shuffle_dataset=False,
        max_steps=steps,
        seed=w.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
    )


def _recorder_cls():
    """A TrainerCallback that keeps one record per optimizer step (defined lazily: imports transformers)."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []
            self.current: dict = {}
            self._last_end: float | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.current = {"t_begin": time.perf_counter(), "generate_s": 0.0, "rollout_s": 0.0}
            self.current.update(completion_tokens=0, train_tokens=0)

        def on_step_end(self, args, state, control, **kwargs):
            now, c = time.perf_counter(), self.current
            in_step = now - c.pop("t_begin")
            c["seconds"] = now - (self._last_end if self._last_end is not None else now - in_step)
            c["train_s"] = in_step - c["rollout_s"]
            c["other_s"] = c["seconds"] - in_step
            self._last_end = now
            self.steps.append(c)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and self.steps:
                self.steps[-1]["reward_mean"] = float(logs["reward"])
                self.steps[-1]["response_len_mean"] = float(logs.get("completions/mean_length", float("nan")))

    return StepRecorder


def _timed_trainer_cls():
    """GRPOTrainer that times its generation and its whole rollout (generate + score + advantages)."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        recorder = None  # set after construction

        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            self.recorder.current["generate_s"] += time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            c = self.recorder.current
            c["rollout_s"] += time.perf_counter() - t0
            completion = int(out["completion_mask"].sum())
            c["completion_tokens"] += completion
            c["train_tokens"] += completion + int(out["prompt_mask"].sum())
            return out

    return TimedGRPOTrainer


def run_trl(w: Workload, steps: int) -> tuple[list[dict], dict]:
    """`steps` optimizer steps of TRL's GRPOTrainer on the workload: one record per step, and what ran."""
    from transformers import AutoTokenizer

    from tidal.convert import ensure_model

    model_dir = ensure_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dataset = _trl_dataset(tidal_prompt_order(w, steps, tokenizer))
    recorder = _recorder_cls()()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        trainer = _timed_trainer_cls()(
            model=str(model_dir),
            reward_funcs=math_reward,
            args=trl_config(w, steps, tmp),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[recorder],
        )
        trainer.recorder = recorder
        trainer.train()
    info = {
        "dtype": trl_dtype(w),
        "weights_dtype": str(trainer.model.dtype),
        "mixed_precision": trainer.accelerator.mixed_precision,
        # accelerate wraps forward in autocast, so HF generate inside TRL runs under it too
        "forward_autocast": hasattr(trainer.model, "_original_forward"),
        "generation": "transformers generate (no vLLM, no continuous batching)",
    }
    return recorder.steps, info


# -- processes ------------------------------------------------------------------------------------


def child_main() -> None:
    """Entry point of one measured process: run one framework, print `RESULT {json}`."""
    import torch

    from bench.common import peak_rss_mb

    p = argparse.ArgumentParser(description="one framework's GRPO run (started by bench.grpo_step / bench.learning)")
    p.add_argument("--framework", choices=FRAMEWORKS, required=True)
    p.add_argument("--steps", type=int, required=True, help="measured steps (after the warm-up ones)")
    p.add_argument("--warmup", type=int, default=1)
    add_workload_args(p)
    args = p.parse_args()
    w = workload_from_args(args)
    torch.set_num_threads(w.threads)
    t0 = time.perf_counter()
    run = run_tidal if args.framework == "tidal" else run_trl
    steps, info = run(w, args.warmup + args.steps)
    res = {
        "framework": args.framework,
        "info": info,
        "warmup_steps": steps[: args.warmup],
        "steps": steps[args.warmup :],
        "process_s": time.perf_counter() - t0,
        "peak_rss_mb": peak_rss_mb(),
        "torch_threads": torch.get_num_threads(),
        # this run alone loads the machine by about `threads`; much more means something else ran too
        "loadavg_1m_at_end": os.getloadavg()[0],
        # torch's huge pages for CPU tensors, as this process started (importing tidal sets it later,
        # after torch has read it)
        "thp_mem_alloc": START_ENV.get("THP_MEM_ALLOC_ENABLE"),
        # glibc keeping freed blocks for reuse: tidal's trainer asks for it (`keep_freed_memory`)
        "keep_freed_memory": args.framework == "tidal" and START_ENV.get("TIDAL_KEEP_FREED_MEMORY") != "0",
    }
    print("RESULT " + json.dumps(res), flush=True)


def run_child(framework: str, w: Workload, steps: int, warmup: int, timeout: float | None = None) -> dict:
    """Run one framework in a fresh process and return its RESULT (exits with its stderr on failure,
    or when it runs past `timeout` seconds)."""
    base, options = VARIANTS.get(framework, (framework, {}))
    w = replace(w, **options)
    cmd = [sys.executable, "-m", "bench.trl_runner", "--framework", base]
    cmd += ["--steps", str(steps), "--warmup", str(warmup)]
    for k, v in asdict(w).items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(START_ENV)
    if base == "tidal":  # as `tidal train` runs; TRL's process keeps the environment as given
        from tidal import ALLOCATOR_ENV

        env = {**ALLOCATOR_ENV, **env}
    res = run_measurement(cmd, f"{framework} run", env, timeout)
    res["framework"] = framework
    res["wall_s"] = res["process_seconds"]  # the name grpo_step/learning JSON has always used
    return res


def add_run_args(p: argparse.ArgumentParser, steps: int, steps_help: str) -> None:
    """The options every tidal-vs-TRL benchmark shares: steps, repeats, frameworks, the workload."""
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--repeats", type=int, default=1, help="runs per framework (alternating)")
    p.add_argument("--frameworks", nargs="+", choices=[*FRAMEWORKS, *VARIANTS], default=list(FRAMEWORKS))
    add_workload_args(p)


def run_alternating(
    args: argparse.Namespace, warmup: int, describe, new_seed_per_repeat: bool = False
) -> dict[str, list[dict]]:
    """`args.repeats` rounds of one run per framework (tidal, TRL, tidal, TRL ...), so a machine
    that slows down or speeds up mid-benchmark affects both alike; prints `describe(run)` for
    each run as it ends. With `new_seed_per_repeat`, round k uses seed `args.seed + k` (the
    sampling and training seeds; the prompt order stays), so repeats are independent samples
    rather than replays.
    Returns the runs by framework."""
    w = workload_from_args(args)
    runs: dict[str, list[dict]] = {f: [] for f in args.frameworks}
    for rep in range(args.repeats):
        wr = replace(w, seed=w.seed + rep) if new_seed_per_repeat else w
        for fw in args.frameworks:
            r = run_child(fw, wr, args.steps, warmup)
            r["seed"] = wr.seed
            runs[fw].append(r)
            print(f"  run {rep + 1} {fw:<6} {describe(r)}  ({run_note(r)})", flush=True)
    return runs


def run_note(res: dict) -> str:
    """`process 95 s, load 2.1` for a progress line: a load well above `threads` means a shared machine."""
    return f"process {res['wall_s']:.0f} s, load {res['loadavg_1m_at_end']:.1f}"


def versions() -> dict:
    """Versions of the peer baseline's packages (bench.common.machine has torch/transformers)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("trl", "accelerate", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    child_main()
