"""Tensor parallelism on trainer ranks (`cluster.tp_size`, `tidal.train.parallel`): two ranks that
split every layer (TP 2), and four as TP 2 × DP 2, take the step one process takes (losses with
the KL term, gradient norm, updated weights, the reference's and policy's log-probs), each rank
holding its part of each split matrix: for a tiny Llama, and for tiny MoE models whose experts are
split whole over the ranks (expert parallelism): Qwen3-MoE (per-head q/k norms whole on each
rank), Mixtral, and DeepSeek-V3 (latent attention, a shared expert, grouped routing); and for
families whose plans gather a split's output or split a whole input (Qwen3.5 with its GDN layers,
Phi-3, OLMo-2)."""

import dataclasses
import functools

import pytest
import torch
from conftest import (
    assert_first_step_close,
    assert_ranks_match,
    make_moe_model,
    make_samples,
    record_step_grads,
    single_process_step,
    spawn_ranks,
)
from families import tiny_model

from tidal.algo.options import AlgoConfig
from tidal.options import ConfigError
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig

TRAIN = TrainConfig(
    global_batch_size=4, max_tokens_per_micro_batch=24, packing=True, lr=1e-3, dtype="float32", max_grad_norm=1.0
)
# the MoE models take the 8 samples as one optimizer step: see `_assert_same_step`
ONE_STEP = dataclasses.replace(TRAIN, global_batch_size=8)
ALGO = AlgoConfig(kl_coef=0.1)
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def copied(weights: dict | None) -> dict | None:
    """A copy: with one dp rank a whole tensor needs no gather and may be the parameter itself."""
    return None if weights is None else {k: v.clone() for k, v in weights.items()}


def _rank_main(rank: int, world: int, init: str, out: str, tp: int, model_dir: str, train: TrainConfig) -> None:
    from tidal.cluster.trainers import TrainerRank

    tr = TrainerRank(rank, world, init, train, ALGO, model_dir, model_dir, 0.8, 0, 16, 1, 120, tp_size=tp)
    samples = make_samples(8, seed=3)
    grads = record_step_grads(tr.actor)  # the last optimizer step's (clipped) gradients, gathered
    sums, extra = tr.train_sums(samples, ADV, None, None)
    modules = dict(tr.actor.model.named_modules())
    attention = modules.get("model.layers.0.self_attn.q_proj")  # Phi-3 has a fused qkv_proj, Qwen3.5 GDN first
    q = attention.weight if attention is not None else None
    experts = [m.gate_up_proj for n, m in modules.items() if n.endswith("mlp.experts")]
    head = tr.actor.model.lm_head
    result = {
        "grads": dict(grads),  # this step's: the dict follows later steps
        "sums": sums,
        "extra": extra,
        "policy": tr.compute_log_probs(samples, "policy"),
        "reference": tr.compute_log_probs(samples, "reference"),
        "weights": copied(tr.full_weights(None)),
        "q_held": q.to_local().numel() if q is not None else None,
        "experts_held": [e.to_local().numel() for e in experts],
        "q_placements": [str(p) for p in q.placements] if q is not None else None,
        "vocab": (tr.actor.trained.vocab.start, tr.actor.trained.vocab.size),  # its slice of the logits
        "head_placements": len(head.weight.placements),
        "tied": head.weight is tr.actor.model.model.embed_tokens.weight,
        "state": tr.state_dict(),  # the optimizer state, full tensors by name (a collective)
    }
    tr.train_sums(samples, -ADV, None, None)  # the run continues on its mesh
    result["weights2"] = copied(tr.full_weights(None))
    torch.save(result, f"{out}.{rank}")
    torch.distributed.barrier()
    tr.close()


# families whose plans gather a split's output, or split a whole input: Qwen3.5's GDN projections,
# Phi-3's fused q/k/v and gate/up, OLMo-2's q/k/v (its q/k norms span every head)
GATHERED = ("qwen3_5_text", "phi3", "olmo2")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_model_dir, tokenizer):
    """{name: a local HF folder}: the tiny Llama, and the tiny MoE models of `make_moe_model`."""
    dirs = {"llama": tiny_model_dir}
    for family in ("qwen3_moe", "mixtral", "deepseek_v3"):
        path = tmp_path_factory.mktemp(family)
        make_moe_model(family).save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[family] = path
    for family in GATHERED:
        path = tmp_path_factory.mktemp(family)
        tiny_model(family).save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[family] = path
    return dirs


@pytest.fixture(scope="module")
def run_ranks(tmp_path_factory, model_dirs):
    """`run_ranks(world, tp, model)`: each rank's results, the ranks run once per layout."""

    @functools.cache
    def run(world: int, tp: int, model: str = "llama") -> list[dict]:
        out = str(tmp_path_factory.mktemp(f"{model}-tp{tp}x{world // tp}") / "rank")
        train = TRAIN if model == "llama" else ONE_STEP
        return spawn_ranks(_rank_main, world, out, tp, str(model_dirs[model]), train)

    return run


@pytest.fixture(scope="module")
def single(model_dirs):
    """`single(model)`: one process's step (metrics, gradients, log-probs, weights after it)."""

    @functools.cache
    def run(model: str = "llama") -> dict:
        path = str(model_dirs[model])
        actor = Actor(path, TRAIN if model == "llama" else ONE_STEP, ALGO, 0.8, 0, path, 16)
        return single_process_step(actor, make_samples(8, seed=3), ADV)

    return run


def _assert_same_step(
    ranks: list[dict], single: dict, tp: int, grad_atol: float = 1e-6, sensitive: bool = False
) -> None:
    """The ranks' step equals the single process's: losses, gradient norm, the last optimizer
    step's gradients (within `grad_atol`), weights after the step, policy and reference
    log-probs."""
    # the weights AdamW moved by float noise (up to lr each) move the policy's log-probs after the step
    assert_ranks_match(ranks, single, tp, grad_atol, policy_atol=1e-3 if sensitive else 1e-5)
    if sensitive:  # one optimizer step, near-zero gradients (`assert_first_step_close`)
        assert_first_step_close(ranks[0]["weights"], single["weights"], single["grads"], TRAIN.lr)
    else:
        # AdamW divides each gradient by its own running scale, so where a gradient is near zero
        # the float-order noise of the split sums (1e-7 relative) reaches the update: up to 7.4e-6
        # of one element at lr 1e-3
        for name, w in single["weights"].items():
            torch.testing.assert_close(ranks[0]["weights"][name], w, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (4, 2)], ids=["tp2", "tp2xdp2"])
def test_tensor_parallel_ranks_take_the_single_process_step(run_ranks, single, world, tp):
    ranks = run_ranks(world, tp)
    single = single()
    _assert_same_step(ranks, single, tp)
    # q_proj's rows (its heads) split over tp, then over dp by FSDP2
    whole = single["weights"]["model.layers.0.self_attn.q_proj.weight"].numel()
    assert all(r["q_held"] == whole // world for r in ranks)
    assert len(ranks[0]["q_placements"]) == 2  # one placement per mesh dimension: dp and tp
    # the output projection (tied to the embedding, still one parameter) split by vocabulary rows
    # over tp: a rank computes 160 of the 320 logits
    assert [r["vocab"] for r in ranks] == [(160 * (i % tp), 160) for i in range(world)]
    assert all(r["tied"] and r["head_placements"] == 2 for r in ranks)


@pytest.mark.parametrize(
    ("model", "world", "tp", "experts"),
    [("qwen3_moe", 2, 2, 8), ("qwen3_moe", 4, 2, 8), ("mixtral", 2, 2, 4), ("deepseek_v3", 2, 2, 8)],
    ids=["qwen3_moe-tp2", "qwen3_moe-tp2xdp2", "mixtral-tp2", "deepseek_v3-tp2"],
)
def test_moe_ranks_split_the_experts_and_take_the_single_process_step(run_ranks, single, model, world, tp, experts):
    """Each tp rank holds experts / tp whole experts (then 1 / dp of those): the router's and the
    q/k norms' gradients (whole weights used on a rank's experts and heads) summed over the ranks
    give the single process's."""
    ranks = run_ranks(world, tp, model)
    base = single(model)
    # weights of std 0.2 (the Llama's: 0.02) make gradients up to 0.06 and the float-order noise of
    # the split sums up to 1.5e-6 (2.4e-5 of the largest)
    _assert_same_step(ranks, base, tp, grad_atol=3e-6, sensitive=True)
    names = [n for n in base["weights"] if n.endswith("mlp.experts.gate_up_proj")]
    whole = base["weights"][names[0]]
    assert whole.shape[0] == experts
    assert all(r["experts_held"] == [whole.numel() // world] * len(names) for r in ranks)
    if model == "qwen3_moe":  # the norms' gradients are the whole ones (checked above), not a rank's part
        assert base["grads"]["model.layers.0.self_attn.q_norm.weight"].abs().sum() > 0


@pytest.mark.parametrize("family", GATHERED)
def test_gathered_and_split_input_styles_take_the_single_process_step(run_ranks, single, family):
    _assert_same_step(run_ranks(2, 2, family), single(family), 2, grad_atol=3e-6, sensitive=True)


def test_a_family_with_another_split_is_refused_naming_it():
    from transformers import DeepseekV2Config

    from tidal.train.parallel import tp_plan

    model = torch.nn.Module()
    model.config = DeepseekV2Config()
    with pytest.raises(ConfigError) as e:
        tp_plan(model)
    assert str(e.value) == (
        "cluster.tp_size: deepseek_v2's plan splits layers.*.self_attn.kv_a_proj_with_mqa as 'mla_kv_a_proj'; "
        "tidal's tensor parallelism runs the colwise, rowwise, colwise_gather_output, rowwise_split_input, "
        "replicated_with_grad_allreduce, moe_tp_experts, embedding_rowwise styles only"
    )
    # an MoE plan: the experts split whole, their tensors' own entries unused
    plan = tp_plan(make_moe_model("qwen3_moe"))
    assert plan["mlp.experts"] == "moe_tp_experts" and "mlp.experts.gate_up_proj" not in plan
    assert plan["self_attn.q_norm"] == "replicated_with_grad_allreduce"


def test_a_tp2_x_dp2_checkpoint_resumes_on_one_process(run_ranks, tiny_model_dir, tmp_path):
    """The state four ranks saved as TP 2 × DP 2 (weights and optimizer state as full tensors by
    name) continues in one process as the four ranks continued."""
    ranks = run_ranks(4, 2)
    step1 = tmp_path / "step1"
    base = Actor(str(tiny_model_dir), TRAIN, ALGO, 0.8, 0, str(tiny_model_dir), 16)
    base.model.load_state_dict(ranks[0]["weights"], strict=False)
    base.model.save_pretrained(step1)
    resumed = Actor(str(step1), TRAIN, ALGO, 0.8, 0, str(tiny_model_dir), 16)
    resumed.load_state_dict(ranks[0]["state"])
    resumed.train_step(make_samples(8, seed=3), -ADV)
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(ranks[0]["weights2"][name], p.detach(), atol=1e-5, rtol=1e-5)


def _vocab_main(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from tidal.net import join_store
    from tidal.train.parallel import VocabSplit, vocab_log_probs_and_entropy

    dist.init_process_group("gloo", store=join_store(init, 120), rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 40, generator=gen)
    labels = torch.tensor([0, 19, 20, 39, 7, 33])  # on either side of the split
    mine = logits[:, rank * 20 : (rank + 1) * 20].clone().requires_grad_(True)
    logp, ent = vocab_log_probs_and_entropy(mine, labels, VocabSplit(rank * 20, 20, dist.group.WORLD), 0.7)
    (logp * torch.arange(1.0, 7.0) + ent * torch.linspace(-1, 1, 6)).sum().backward()
    torch.save({"logp": logp.detach(), "ent": ent.detach(), "grad": mine.grad}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_the_vocabulary_split_log_softmax_gives_the_whole_ones_values_and_gradient(tmp_path):
    from tidal.algo import log_probs_and_entropy

    parts = spawn_ranks(_vocab_main, 2, str(tmp_path / "vocab"))
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(6, 40, generator=gen)).requires_grad_(True)
    logp, ent = log_probs_and_entropy(logits, torch.tensor([0, 19, 20, 39, 7, 33]), 0.7)
    (logp * torch.arange(1.0, 7.0) + ent * torch.linspace(-1, 1, 6)).sum().backward()
    for part in parts:
        assert torch.allclose(part["logp"], logp.detach(), atol=1e-6)
        assert torch.allclose(part["ent"], ent.detach(), atol=1e-6)
    assert torch.allclose(torch.cat([p["grad"] for p in parts], dim=1), logits.grad, atol=1e-6)
