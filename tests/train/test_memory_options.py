"""The memory options GPU users turn on change where things live, never the step."""

import pytest
import torch
from conftest import make_model, make_samples
from torch.utils._python_dispatch import TorchDispatchMode

from tidal.algo.options import AlgoConfig
from tidal.train import recompute
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig
from tidal.train.update import MOMENTS

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def two_steps(**train) -> tuple[Actor, list[dict]]:
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, lr=1e-3, dtype="float32", packing=False, **train)
    actor = Actor(make_model(seed=0), cfg, AlgoConfig(), temperature=0.8)
    samples = make_samples()
    return actor, [actor.train_step(samples, ADV), actor.train_step(samples, -ADV)]


@pytest.mark.parametrize(
    "option",
    [{"gradient_checkpointing": True}, {"gradient_checkpointing": "selective"}, {"offload_optimizer": True}],
)
def test_a_memory_option_takes_exactly_the_same_steps(option):
    base, base_m = two_steps()
    got, got_m = two_steps(**option)
    for a, b in zip(base_m, got_m, strict=True):
        assert a["loss/pg"] == pytest.approx(b["loss/pg"], rel=1e-6, abs=1e-9)
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-6)
    for p, q in zip(base.params, got.params, strict=True):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)
    if option.get("gradient_checkpointing"):
        flag = "is_activation_checkpointing"
        flag = flag if hasattr(got.model, flag) else "is_gradient_checkpointing"
        assert getattr(got.model, flag) and not getattr(base.model, flag)


class CountMatmuls(TorchDispatchMode):
    """Counts the matrix products that run (a replayed, cached output runs none)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def matmuls_in_a_step(mode) -> int:
    cfg = TrainConfig(micro_batch_size=8, global_batch_size=8, lr=1e-3, dtype="float32", gradient_checkpointing=mode)
    actor = Actor(make_model(seed=0), cfg, AlgoConfig(), temperature=0.8)
    with CountMatmuls() as counter:
        actor.train_step(make_samples(), ADV)
    return counter.calls


def test_selective_checkpointing_recomputes_no_matmul_and_full_recomputes_each_layers():
    """`selective` replays the layers' matmul outputs in the backward; `full` runs them again: of
    each of the tiny model's 2 layers' 7 products, all but the last (down, whose output no backward
    reads: torch's recompute stops when it has every saved tensor back)."""
    off, selective, full = (matmuls_in_a_step(m) for m in (False, "selective", True))
    assert selective == off
    assert full == off + 2 * 6


def test_an_unknown_checkpointing_mode_is_refused_by_name():
    errors = []
    TrainConfig(gradient_checkpointing="some").check(lambda ok, msg: ok or errors.append(msg))
    assert errors == ["train.gradient_checkpointing: false, true, full or selective, got 'some'"]


def test_offloaded_moments_move_to_the_device_given_and_back():
    """The mover takes every AdamW moment to the device asked for (here `meta`, a device a CPU has
    besides its own) and leaves the step counts where AdamW keeps them."""
    actor, _ = two_steps(offload_optimizer=True)
    opt = actor.opt
    states = list(opt.optimizer.state.values())
    assert len(states) == len(actor.params)
    steps = [s["step"].device for s in states]
    opt.move_state("meta")
    assert all(s[k].device.type == "meta" for s in states for k in MOMENTS if k in s)
    assert all("exp_avg" in s and "exp_avg_sq" in s for s in states)
    assert [s["step"].device for s in states] == steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "autocast"])
def test_norms_and_swiglu_keep_their_inputs_and_the_backward_is_the_same_bits(dtype):
    """Without layer checkpointing, the tiny Llama's 5 RMSNorms and 2 SwiGLU MLPs keep only their
    inputs for the backward (`recompute.inputs_only`): the loss and every gradient are the same
    bits as the unchanged model's (fp32 and bf16 weights, and bf16 autocast over fp32 ones)."""
    weights_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    plain, lean = make_model(seed=0).to(weights_dtype), make_model(seed=0).to(weights_dtype)
    assert recompute.inputs_only(lean) == {"norms": 5, "mlps": 2}
    ids = torch.tensor([[5, 9, 17, 3, 44, 8, 12]])
    weights = torch.randn(1, 7, 320, generator=torch.Generator().manual_seed(1)).to(weights_dtype)
    for m in (plain, lean):
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "autocast"):
            loss = (m(input_ids=ids).logits * weights).sum()
        loss.backward()
    for (name, p), q in zip(plain.named_parameters(), lean.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def _kept_numbers(fn, x: torch.Tensor, params) -> int:
    """How many numbers autograd keeps for the backward of `fn(x)`, the parameters not counted."""
    own = {p.untyped_storage().data_ptr() for p in params}
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x).sum()
    y.backward()  # what the backward keeps for its own recompute is gone when it returns
    return sum(kept.values())


def test_a_swiglu_mlp_keeps_its_input_gate_and_up_and_not_the_product_its_down_projection_reads():
    mlp = make_model(seed=0).model.layers[0].mlp
    hidden, inner = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    x = torch.randn(1, 7, hidden, requires_grad=True)
    # the layer's own forward: x, gate (for act), act(gate) and up (for the product), the product
    assert _kept_numbers(mlp, x, mlp.parameters()) == 7 * hidden + 4 * 7 * inner
    recompute.inputs_only(mlp)
    assert _kept_numbers(mlp, x, mlp.parameters()) == 7 * hidden + 2 * 7 * inner


class SwappedMLP(torch.nn.Module):
    """Gate and up in each other's places: not the formula `inputs_only` computes."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(4, 4) for _ in range(3))
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def test_an_mlp_of_another_formula_keeps_its_own_forward():
    mlp = SwappedMLP()
    assert recompute.inputs_only(mlp) == {"norms": 0, "mlps": 0}
    assert "forward" not in vars(mlp)


def test_what_adamw_writes_leaves_the_checkpoints_file_and_frozen_weights_stay_mapped(tiny_model_dir):
    """transformers hands over a safetensors checkpoint's tensors as views of the file mapped
    copy-on-write (memory torch did not allocate, so not resizable): the trainer copies each
    trainable weight into memory of its own, value for value; a LoRA's frozen base stays mapped."""
    from tidal.train.model import TrainedModel, load_causal_lm

    loaded = load_causal_lm(tiny_model_dir)
    assert not any(p.untyped_storage().resizable() for p in loaded.parameters())
    want = {n: p.detach().clone() for n, p in loaded.named_parameters()}
    full = TrainedModel(loaded, TrainConfig(dtype="float32"))
    for n, p in full.master.named_parameters():
        assert p.untyped_storage().resizable(), n
        assert torch.equal(p, want[n]), n
    lora = TrainedModel(load_causal_lm(tiny_model_dir), TrainConfig(dtype="float32", lora_rank=4, lora_alpha=8.0))
    frozen = [p for p in lora.master.parameters() if not p.requires_grad]
    assert len(frozen) == len(want)
    assert not any(p.untyped_storage().resizable() for p in frozen)
    assert all(p.untyped_storage().resizable() for p in lora.master.parameters() if p.requires_grad)
