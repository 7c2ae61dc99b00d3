"""Tiny random causal LMs of every model family the tidal engine is meant to run, built from each
family's transformers config class (nothing downloaded), plus transformers' own greedy tokens
and log-probs to compare an engine with.

Every model: fp32, eval mode, vocabulary 320 (so conftest's `make_tokenizer` fits, eos id 2),
hidden size 64, 2-3 layers, untied embeddings, and weights redrawn from a seeded normal with a
large std, so greedy choices are well separated and MoE routers pick different experts for
different tokens (transformers' default init, std 0.02, gives near-uniform logits).
Each family sets the features that make it differ from Llama (see `_CONFIGS`).
"""

from __future__ import annotations

import torch

_BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    eos_token_id=2,
    pad_token_id=0,
    bos_token_id=None,
)
WINDOW = 6  # sliding window of the families that have one: prompts of 10-20 tokens outgrow it

# the Gated DeltaNet families' layers: linear, attention, linear
_GDN = dict(
    num_hidden_layers=3,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
_LFM2 = dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3)
# the Mamba-2 families' mixers: 4 heads of 16, one group, state 8, conv kernel 4, chunks of 8
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8)

# model_type -> its config on top of _BASE
_CONFIGS: dict[str, dict] = {
    "llama": {},
    # every layer slides over the last WINDOW keys
    "mistral": dict(sliding_window=WINDOW),
    # q/k/v projections with biases (always, in Qwen2Attention)
    "qwen2": {},
    # per-head RMSNorm of q and k; head_dim 32 with 4 heads (q_proj wider than hidden, as in Qwen3)
    "qwen3": dict(head_dim=32),
    # layers alternate sliding (window WINDOW) / global; tanh soft-capping of attention scores and
    # of the final logits; scaling query_pre_attn_scalar ** -0.5 with 24 != head_dim 16;
    # (1 + w) RMSNorms, pre- and post-norms, embeddings scaled by sqrt(hidden)
    "gemma2": dict(
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0,
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
    ),
    # sliding (local rope base 10k) and global (base 1M) layers, q/k norms, query_pre_attn_scalar
    "gemma3_text": dict(
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    ),
    # fused qkv_proj and gate_up_proj; rotary on 3/4 of each head (Phi-4-mini's 0.75)
    "phi3": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75},
    ),
    # GLM-4: rotary on the first half of each head, in interleaved pairs; q/k/v biases;
    # post-attention and post-MLP norms; fused gate_up_proj
    "glm4": dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True),
    # norms after attention and MLP (not before), q/k RMSNorm over all heads at once
    "olmo2": {},
    # 4 experts, top-2, renormalised top-k weights; layer 0 a dense MLP (mlp_only_layers)
    "qwen3_moe": dict(
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    # 4 experts, top-2, softmax router, no sliding window
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    # GLM-4.5: layer 0 dense, then sigmoid-routed experts (8, top-2 in the best 2 of 4 groups)
    # plus a shared expert, scaled weights, q/k norm, half rotary, q/k/v biases
    "glm4_moe": dict(
        num_hidden_layers=3,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
        num_mtp_layers=0,
    ),
    # MLA: low-rank q (q_lora_rank) and kv (kv_lora_rank); q/k heads of 16 nope + 8 rope dims,
    # v heads of 12; interleaved rope; layer 0 dense, then 8 experts top-2 in 2 of 4 groups,
    # a shared expert, routed_scaling_factor 2.5
    "deepseek_v3": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_mtp_layers=0,
    ),
    # hybrid families: recurrent token mixers between (or beside) attention layers
    # Qwen3-Next: Gated DeltaNet layers around a gated attention layer (partial rotary), grouped
    # value heads (4 v over 2 k), conv kernel 4; MoE layers with a sigmoid-gated shared expert
    "qwen3_next": dict(
        **_GDN,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
    ),
    # Qwen3.5's language model: Gated DeltaNet as Qwen3-Next, dense MLPs
    "qwen3_5_text": _GDN,
    # Qwen3.5-MoE's language model: as qwen3_5_text with MoE layers and a gated shared expert
    "qwen3_5_moe_text": dict(
        **_GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    # LFM2: gated short convolutions (kernel 3) around an attention layer with q/k norms
    "lfm2": _LFM2,
    # LFM2-MoE: layer 0 dense, then sigmoid-routed experts with an expert bias, scaled weights
    "lfm2_moe": dict(
        **_LFM2,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        use_expert_bias=True,
        routed_scaling_factor=2.0,
        norm_topk_prob=True,
    ),
    # Falcon-H1: Mamba-2 (4 heads of 16, state 8, chunks of 8) beside attention in every layer
    "falcon_h1": dict(
        head_dim=16,
        mamba_d_ssm=64,
        **_MAMBA2,
    ),
    # Granite 4 hybrid: Mamba-2 layers around an attention layer, MoE (4 experts, top-2) with a
    # shared MLP
    "granitemoehybrid": dict(
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        **_MAMBA2,
        mamba_expand=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
    ),
}
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "falcon_h1", "granitemoehybrid")
# the families with MoE layers (routing recorded by the engine, replayed by the trainer)
MOE = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5_moe_text", "lfm2_moe")
MOE += ("granitemoehybrid",)
# sdpa has no soft-capping: transformers itself refuses sdpa for Gemma2 (its default is eager)
_EAGER = {"gemma2"}

FAMILIES: tuple[str, ...] = tuple(_CONFIGS)


def tiny_config(family: str, **overrides):
    """The family's transformers config with the tiny sizes and its distinguishing features."""
    from transformers import AutoConfig

    if family not in _CONFIGS:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    values = {**_BASE, **_CONFIGS[family], **overrides}
    return AutoConfig.for_model(family, **values)


def tiny_model(family: str, seed: int = 0, **overrides):
    """A tiny random fp32 causal LM of `family` (a model_type), in eval mode; same seed, same weights."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **overrides)
    attn = "eager" if family in _EAGER else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    _reinit(model, seed)
    return model.eval()


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Redraw every parameter from a seeded generator: matrices (projections, embeddings, expert
    stacks, routers) and biases ~ N(0, std); norm weights keep their default (1, or 0 where the
    norm computes 1 + w) plus N(0, 0.1) noise. Buffers (rotary tables, routers'
    `e_score_correction_bias`) stay as they are."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if p.dim() == 1 and "norm" in name:
            p.add_(0.1 * noise.to(p.dtype))
        else:
            p.copy_(std * noise)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: exactly n tokens (eos does not stop it),
    from `generate` with its own KV cache."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,  # overrides the model's generation config (eos 2)
            pad_token_id=0,
        )
    toks = out[0, len(prompt) :].tolist()
    assert len(toks) == n, f"generate stopped after {len(toks)} of {n} tokens"
    return toks


def hf_logprobs(model, ids: list[int], n_prompt: int, temperature: float = 1.0) -> list[float]:
    """log-softmax(logits / temperature) log-probs of ids[n_prompt:], from one full forward of
    transformers over `ids` (no cache)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[j - 1, ids[j]].item() for j in range(n_prompt, len(ids))]


def hf_forward_greedy_ok(model, prompt: list[int], tokens: list[int]) -> bool:
    """Whether each of `tokens` is the argmax of one full forward over prompt + tokens: the
    reference's own check that `generate` (with its cache) agrees with the uncached model."""
    ids = prompt + tokens
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return logits[len(prompt) - 1 : len(ids) - 1].argmax(-1).tolist() == tokens
