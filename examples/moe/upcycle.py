"""Make a real MoE to train on a CPU: SmolLM2-135M-Instruct sparse-upcycled into a Mixtral.

    python examples/moe/upcycle.py --out runs/smollm2-moe          # 4 experts, top-2
    tidal train --config examples/moe/config.yaml

No MoE checkpoint can be downloaded here, and a random one learns nothing a reward can show.
Upcycling makes one that starts as a model that already answers: every expert is a copy of
SmolLM2's MLP (Mixtral's attention, norms and rotary are Llama's), and the router is a small
random matrix. Mixtral renormalises its top-k weights, so at step 0

    y = sum_j w_j · MLP(x) = MLP(x)      (sum_j w_j = 1)

and the MoE computes SmolLM2 exactly (checked below on one prompt). Training then moves the
experts apart and the router learns which to use; the routing is the part the engine and the
trainer must agree on, which `algo.routing_replay` makes sure of.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def upcycle(dense_dir: Path, out: Path, experts: int, top_k: int, router_std: float, seed: int) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval()
    c = dense.config
    if c.model_type != "llama":
        raise SystemExit(f"upcycle: {dense_dir} is a {c.model_type} model; this script upcycles Llama-shaped ones")
    cfg = MixtralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
    moe = MixtralForCausalLM(cfg).eval()
    src = dense.state_dict()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if ".mlp.experts.gate_up_proj" in name:  # [E, 2I, H]: gate rows, then up rows
                layer = name.split(".mlp.")[0]
                gate_up = torch.cat([src[f"{layer}.mlp.gate_proj.weight"], src[f"{layer}.mlp.up_proj.weight"]])
                p.copy_(gate_up.expand(experts, -1, -1))
            elif ".mlp.experts.down_proj" in name:  # [E, H, I]
                layer = name.split(".mlp.")[0]
                p.copy_(src[f"{layer}.mlp.down_proj.weight"].expand(experts, -1, -1))
            elif ".mlp.gate.weight" in name:  # the router: small, so the first choices are near-random
                p.copy_(torch.randn(p.shape, generator=gen) * router_std)
            else:
                p.copy_(src[name])
    ids = torch.tensor([[1, 504, 3458, 314, 216, 28, 1459, 216, 37, 47]])
    with torch.no_grad():
        gap = float((moe(ids).logits - dense(ids).logits).abs().max())
    if gap > 1e-3:
        raise SystemExit(f"upcycle: the MoE's logits differ from the dense model's by {gap:.2e}")
    out.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(dense_dir)).save_pretrained(str(out))
    n = sum(p.numel() for p in moe.parameters())
    print(f"wrote {out}: Mixtral, {experts} experts top-{top_k}, {n / 1e6:.0f}M parameters")
    print(f"its logits equal the dense model's to {gap:.1e}")
    return out


def main() -> None:
    from tidal.convert import ensure_model

    p = argparse.ArgumentParser(description="SmolLM2-135M-Instruct sparse-upcycled into a Mixtral MoE")
    p.add_argument("--out", type=Path, default=Path("runs/smollm2-moe"))
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--router-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    upcycle(ensure_model("smollm2"), args.out, args.experts, args.top_k, args.router_std, args.seed)


if __name__ == "__main__":
    main()
