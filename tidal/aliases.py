"""What other frameworks (TRL, verl, OpenRLHF, slime) and plain English call tidal's options: the
table behind the suggestion an unknown key gets, on the command line and in a YAML file
(`--train.learning_rate` -> `--train.lr`, `num_generations` -> `rollout.n_samples_per_prompt`).

A word names the last part of a key in any group (`learning_rate`, `actor.optim.learning_rate`);
a dotted entry names a whole key where its last part alone means something else elsewhere.
Several targets are each offered. Suggestions only: an alias is never read as the option.
`tests/test_config.py` checks that every target is a real option.
"""

from __future__ import annotations

ALIASES: dict[str, tuple[str, ...]] = {
    # the model and the run folder
    **dict.fromkeys(
        ("model_name_or_path", "model_name", "model_path", "pretrain", "hf_checkpoint", "base_model"),
        ("train.model",),
    ),
    **dict.fromkeys(
        ("output", "out_dir", "save", "save_dir", "checkpoint_dir", "ckpt_dir", "run_dir"), ("train.output_dir",)
    ),
    # optimisation
    **dict.fromkeys(("learning_rate", "actor_learning_rate", "lr_rate", "step_size"), ("train.lr",)),
    **dict.fromkeys(("critic_learning_rate", "value_lr"), ("algo.critic_lr",)),
    **dict.fromkeys(
        (
            "max_steps",
            "steps",
            "total_training_steps",
            "num_rollout",
            "iterations",
            "num_iterations",
            "num_episodes",
            "epochs",
            "num_train_epochs",
            "total_epochs",
            "max_epochs",
        ),
        ("train.num_steps",),
    ),
    **dict.fromkeys(("warmup", "lr_warmup_steps", "num_warmup_steps", "warmup_ratio"), ("train.warmup_steps",)),
    **dict.fromkeys(("l2", "wd", "adam_weight_decay"), ("train.weight_decay",)),
    **dict.fromkeys(("grad_clip", "clip_grad", "clip_grad_norm", "gradient_clipping"), ("train.max_grad_norm",)),
    **dict.fromkeys(("bf16", "fp16", "precision", "torch_dtype", "param_dtype"), ("train.dtype", "engine.dtype")),
    "betas": ("train.adam_betas",),
    **dict.fromkeys(
        ("ppo_mini_batch_size", "train_batch_size", "mini_batch_size", "optimizer_batch_size"),
        ("train.global_batch_size",),
    ),
    **dict.fromkeys(
        (
            "per_device_train_batch_size",
            "micro_train_batch_size",
            "ppo_micro_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "micro_batch",
        ),
        ("train.micro_batch_size",),
    ),
    "gradient_accumulation_steps": ("train.global_batch_size", "train.micro_batch_size"),
    **dict.fromkeys(("batch_size", "train_batch"), ("rollout.rollout_batch_size", "train.global_batch_size")),
    **dict.fromkeys(("save_steps", "save_freq", "checkpoint_interval", "ckpt_interval"), ("train.save_interval",)),
    **dict.fromkeys(("save_total_limit", "max_ckpt_num", "max_checkpoints"), ("train.keep_checkpoints",)),
    **dict.fromkeys(("lora_r", "r", "rank", "lora_dim"), ("train.lora_rank",)),
    "target_modules": ("train.lora_target_modules",),
    "packing_samples": ("train.packing",),
    # the rollout
    **dict.fromkeys(
        (
            "num_generations",
            "n",
            "num_samples",
            "samples_per_prompt",
            "group_size",
            "num_return_sequences",
            "n_samples",
        ),
        ("rollout.n_samples_per_prompt",),
    ),
    "data.train_batch_size": ("rollout.rollout_batch_size",),
    **dict.fromkeys(("prompts_per_step", "num_prompts", "prompt_batch_size"), ("rollout.rollout_batch_size",)),
    **dict.fromkeys(
        (
            "max_completion_length",
            "max_response_length",
            "response_length",
            "generate_max_len",
            "rollout_max_response_len",
            "max_tokens",
            "max_new_token",
            "max_completion_tokens",
            "max_gen_len",
        ),
        ("rollout.max_new_tokens",),
    ),
    **dict.fromkeys(
        ("prompt_max_len", "rollout_max_prompt_len", "max_prompt_len", "max_input_length"), ("data.max_prompt_length",)
    ),
    "rollout_temperature": ("sampling.temperature",),
    **dict.fromkeys(("stop_sequences", "stop_strings", "stop_words"), ("sampling.stop",)),
    **dict.fromkeys(("rollout_function_path", "custom_generate_function_path", "generate_fn"), ("rollout.generate",)),
    **dict.fromkeys(("use_vllm", "inference_engine", "rollout_engine"), ("engine.kind",)),
    **dict.fromkeys(
        ("gpu_memory_utilization", "vllm_gpu_memory_utilization", "mem_fraction_static"), ("engine.kv_cache_tokens",)
    ),
    # the reward
    **dict.fromkeys(
        (
            "reward",
            "reward_fn",
            "reward_func",
            "reward_funcs",
            "reward_function",
            "reward_model",
            "rm_type",
            "custom_rm_path",
            "remote_rm_url",
            "reward_manager",
        ),
        ("reward.fn",),
    ),
    "group_reward": ("reward.group_fn",),
    # the algorithm
    **dict.fromkeys(
        ("beta", "kl", "kl_coeff", "init_kl_coef", "kl_loss_coef", "kl_beta", "use_kl_loss", "kl_penalty"),
        ("algo.kl_coef",),
    ),
    **dict.fromkeys(("kl_loss_type", "kl_estimator"), ("algo.kl_kind",)),
    **dict.fromkeys(("epsilon", "clip_ratio", "cliprange", "clip_range", "clip_eps", "eps"), ("algo.eps_clip",)),
    **dict.fromkeys(("epsilon_high", "clip_ratio_high", "clip_range_high"), ("algo.eps_clip_high",)),
    "clip_ratio_c": ("algo.dual_clip",),
    **dict.fromkeys(("entropy_coeff", "entropy_loss_coef", "ent_coef", "entropy"), ("algo.entropy_coef",)),
    **dict.fromkeys(("adv_estimator", "advantage_estimator", "estimator"), ("algo.advantage",)),
    **dict.fromkeys(("loss_type", "loss_agg_mode", "loss_aggregation"), ("algo.loss_agg",)),
    **dict.fromkeys(("lambd", "gae_lambda", "lambda_"), ("algo.lam",)),
    "discount": ("algo.gamma",),
    "dynamic_filtering": ("algo.dynamic_sampling",),
    "dynamic_sampling_filter_path": ("algo.dynamic_sampling_filter",),
    "over_sampling_batch_size": ("algo.oversample",),
    **dict.fromkeys(("mask_truncated_completions", "overlong_filtering"), ("algo.mask_truncated",)),
    **dict.fromkeys(("use_tis", "tis", "importance_sampling"), ("algo.is_correction",)),
    # the data
    **dict.fromkeys(
        (
            "dataset",
            "dataset_name",
            "data",
            "data_path",
            "train_files",
            "train_file",
            "prompt_data",
            "train_data",
            "prompts",
        ),
        ("data.path",),
    ),
    "prompt_key": ("data.input_key",),
    "answer_key": ("data.label_key",),
    # evaluation
    **dict.fromkeys(("eval_steps", "eval_freq", "test_freq", "eval_interval", "eval_every"), ("eval.interval",)),
    **dict.fromkeys(
        ("eval_dataset", "eval_data", "val_files", "eval_prompt_data", "eval_datasets"), ("eval.datasets",)
    ),
    # the cluster
    **dict.fromkeys(("num_gpus", "n_gpus_per_node", "actor_num_gpus_per_node", "gpus"), ("cluster.gpus_per_trainer",)),
    **dict.fromkeys(("vllm_num_engines", "num_engines", "rollout_num_engines"), ("cluster.engines",)),
    "rollout_num_gpus_per_engine": ("cluster.gpus_per_engine",),
    **dict.fromkeys(("colocate_all_models", "colocate_actor_ref", "hybrid_engine"), ("cluster.colocate",)),
    **dict.fromkeys(
        ("tensor_model_parallel_size", "expert_model_parallel_size", "model_parallel_size"), ("cluster.tp_size",)
    ),
    "tensor_parallel_size": ("cluster.tp_size", "cluster.gpus_per_engine"),  # vLLM's and SGLang's: an engine's
    **dict.fromkeys(
        ("context_parallel_size", "ulysses_sequence_parallel_size", "sequence_parallel_size", "ring_attn_size"),
        ("cluster.cp_size",),
    ),
    # logging
    **dict.fromkeys(("report_to", "use_wandb", "wandb_run_name"), ("log.wandb",)),
    **dict.fromkeys(("logging_dir", "log_dir"), ("log.dir",)),
}
