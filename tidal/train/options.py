"""The `train` option group: the model, batch sizes, packing, optimizer, precision, LoRA and
checkpoints of the trainer (`tidal.train.actor`, `tidal.cluster.trainers`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidal.options import Need, one_of, opt

TRAIN_DTYPES = ("auto", "bfloat16", "autocast", "float32")
# train.gradient_checkpointing: off, a layer's whole forward again (true = full), or `tidal.train.recompute`'s
CHECKPOINTING = (False, True, "full", "selective")


@dataclass
class TrainConfig:
    model: str = opt("smollm2", "local HF model folder, or smollm2 for the bundled SmolLM2-135M-Instruct")
    output_dir: str = opt("runs/quickstart", "checkpoints, metrics and TensorBoard logs go here")
    num_steps: int = opt(20, "rollout steps to run")
    global_batch_size: int = opt(32, "samples per optimizer step")
    micro_batch_size: int = opt(8, "samples per forward/backward pass (gradient accumulation)")
    max_tokens_per_micro_batch: int = opt(
        0, "pack micro-batches first-fit up to this many tokens instead of micro_batch_size samples (0 = off)"
    )
    packing: bool = opt(True, "concatenate a micro-batch's sequences into one row without padding")
    share_prompts: bool = opt(
        True, "packing: a micro-batch stores a group's shared prompt once (same log-probs, fewer tokens to compute)"
    )
    skip_zero_advantage: bool = opt(
        True,
        "do not compute samples whose loss is exactly 0 (advantage 0 on every token, no KL or entropy term): "
        "the same gradient, less compute",
    )
    lr: float = opt(1e-6, "AdamW learning rate")
    warmup_steps: int = opt(0, "optimizer steps of linear learning-rate warm-up")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_betas: list = opt([0.9, 0.999], "AdamW betas")
    max_grad_norm: float = opt(1.0, "clip the global gradient norm to this (0 = off)")
    dtype: str = opt(
        "auto",
        "compute precision, weights and AdamW stay fp32: auto (bfloat16 where the hardware computes it natively, "
        "else float32) | bfloat16 (a bf16 copy computes) | autocast | float32",
    )
    gradient_checkpointing: bool | str = opt(
        False,
        "recompute activations in backward to save memory: false | true or full (each layer's whole forward "
        "again) | selective (keep the matmuls' and attention's outputs, recompute the cheap ops between them)",
    )
    train_vision: bool = opt(
        False,
        "a vision-language model's vision tower and projector train too (full fine-tuning); false: they stay "
        "frozen and only the language model and its head train",
    )
    offload_optimizer: bool = opt(
        False,
        "keep AdamW's moments in host memory between optimizer steps (on a GPU: 8 bytes per parameter freed "
        "for rollout and activations, at one copy each way per step); no effect on the CPU",
    )
    logits_chunk_tokens: int = opt(
        1024,
        "compute the output projection and log-softmax this many response tokens at a time, so a micro-batch's "
        "[tokens, vocabulary] logits are never held whole (0 = all at once)",
    )
    batch_invariant: bool = opt(
        False,
        "score under batch-invariant numerics (tidal.invariant: attention in float64; matrix products on padded "
        "rows on a CPU, in float64 with the row reductions on a GPU), so with engine.batch_invariant the "
        "trainer's log-probs are the engine's (bit for bit on a CPU: the first ratio is exactly 1); slower "
        "forwards, the same gradients' formula",
    )
    lora_rank: int = opt(
        0,
        "LoRA rank r: train low-rank adapters on the base weights, frozen (0 = full fine-tuning); "
        "LoRA usually wants 10-100x the full fine-tuning train.lr (examples/lora: 1e-3)",
    )
    lora_alpha: float = opt(32.0, "LoRA scale numerator: each adapter's update is scaled by lora_alpha / lora_rank")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input while training")
    lora_target_modules: list | str = opt(
        "all-linear", "linear layers that get adapters, by short name (e.g. [q_proj, v_proj]), or all-linear"
    )
    lora_adapter: str | None = opt(
        None, "a saved adapter folder (peft's, or a tidal export --lora adapter) to start the adapters from"
    )
    lora_merge: bool = opt(
        True,
        "true: engines get the merged W + s*B*A (a plain model's decode speed; the engine holds the merged "
        "matrices); false: the in-process engine runs the adapters' low-rank path on the trainer's own tensors "
        "(no second copy of anything, no sync bytes; slower decode)",
    )
    save_interval: int = opt(0, "save a checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = opt(3, "keep the newest N complete checkpoints, delete older ones after a save (0 = all)")
    max_bad_steps: int = opt(
        3, "optimizer steps with a NaN/Inf loss or gradient are skipped; this many in a row stop the run"
    )
    seed: int = opt(0, "torch seed")
    num_threads: int = opt(0, "torch CPU threads (0 = torch's default)")

    def check(self, need: Need) -> None:
        need(self.num_steps >= 1, f"train.num_steps: must be >= 1, got {self.num_steps}")
        need(self.global_batch_size >= 1, "train.global_batch_size: must be >= 1")
        need(
            1 <= self.micro_batch_size <= max(self.global_batch_size, 1),
            f"train.micro_batch_size: must be between 1 and train.global_batch_size ({self.global_batch_size}), "
            f"got {self.micro_batch_size}",
        )
        need(self.lr > 0, f"train.lr: must be > 0, got {self.lr}")
        need(self.warmup_steps >= 0, "train.warmup_steps: must be >= 0")
        need(self.max_grad_norm >= 0, "train.max_grad_norm: must be >= 0 (0 turns clipping off)")
        one_of(need, "train.dtype", self.dtype, TRAIN_DTYPES)
        need(
            self.gradient_checkpointing in CHECKPOINTING,
            f"train.gradient_checkpointing: false, true, full or selective, got {self.gradient_checkpointing!r}",
        )
        need(
            len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
            f"train.adam_betas: two numbers in [0, 1), got {self.adam_betas}",
        )
        need(self.max_tokens_per_micro_batch >= 0, "train.max_tokens_per_micro_batch: must be >= 0 (0 = off)")
        need(self.save_interval >= 0, "train.save_interval: must be >= 0")
        need(
            self.keep_checkpoints >= 0,
            f"train.keep_checkpoints: must be >= 0 (0 keeps all), got {self.keep_checkpoints}",
        )
        need(self.max_bad_steps >= 1, f"train.max_bad_steps: must be >= 1, got {self.max_bad_steps}")
        need(self.num_threads >= 0, "train.num_threads: must be >= 0")
        need(self.logits_chunk_tokens >= 0, "train.logits_chunk_tokens: must be >= 0 (0 = all at once)")
        need(
            not self.batch_invariant or self.dtype != "autocast",
            "train.batch_invariant: scores in the weights' dtype as the engine does; train.dtype autocast casts "
            "per op (use auto, bfloat16 or float32)",
        )
        need(
            not self.batch_invariant or self.lora_rank == 0,
            "train.batch_invariant: the engine runs merged LoRA weights, which round otherwise than the "
            "trainer's adapters; full fine-tuning only (train.lora_rank 0)",
        )
        self._check_lora(need)

    def _check_lora(self, need: Need) -> None:
        need(self.lora_rank >= 0, f"train.lora_rank: must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.lora_rank == 0:
            need(self.lora_adapter is None, "train.lora_adapter: starts LoRA adapters; set train.lora_rank too")
            return
        need(self.lora_alpha > 0, f"train.lora_alpha: must be > 0, got {self.lora_alpha}")
        need(0 <= self.lora_dropout < 1, f"train.lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        targets = self.lora_target_modules
        need(
            targets == "all-linear"
            or (isinstance(targets, list) and targets and all(isinstance(x, str) and x for x in targets)),
            f"train.lora_target_modules: all-linear or a non-empty list of module names (e.g. [q_proj, v_proj]), "
            f"got {targets!r}",
        )
        need(
            self.lora_adapter is None or (Path(self.lora_adapter) / "adapter_config.json").is_file(),
            f"train.lora_adapter: {self.lora_adapter!r} is not an adapter folder (no adapter_config.json in it)",
        )
