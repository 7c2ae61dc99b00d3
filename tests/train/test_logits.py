"""Chunked output projection + log-softmax: the same log-probs, entropies and gradients as the
whole-logits computation, with the logits never held whole."""

import pytest
import torch

from tidal.algo import log_probs_and_entropy
from tidal.train.logits import token_log_probs, token_log_probs_and_entropy


def setup(dtype, t=37, h=16, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype).requires_grad_()
    head = torch.nn.Linear(h, v, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 2)
    labels = torch.randint(0, v, (t,), generator=g)
    w_lp, w_ent = torch.randn(t, generator=g), torch.randn(t, generator=g)
    return hidden, head, labels, w_lp, w_ent


def grads(hidden, head, fn):
    hidden.grad = head.weight.grad = None
    logp, ent = fn()
    return logp, ent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk", [8, 64])  # 64: the 37 tokens in one chunk
def test_chunked_equals_whole_in_value_and_gradient(dtype, entropy_grad, chunk):
    hidden, head, labels, w_lp, w_ent = setup(dtype)
    results = {}
    for name, size in (("whole", 0), ("chunked", chunk)):
        hidden.grad = head.weight.grad = None
        logp, ent = token_log_probs_and_entropy(hidden, head, labels, 0.7, size, entropy_grad)
        loss = (logp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0.0)
        loss.backward()
        results[name] = (logp.detach(), ent.detach(), hidden.grad.clone(), head.weight.grad.clone())
        assert ent.requires_grad == entropy_grad
    # the reference: tidal.algo on the whole logits
    ref_lp, ref_ent = log_probs_and_entropy(head(hidden), labels, 0.7, entropy_grad)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(results["whole"][0], ref_lp.detach(), **tol)
    for a, b in zip(results["chunked"], results["whole"], strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)
    torch.testing.assert_close(results["chunked"][1], ref_ent.detach(), **tol)


def test_hand_worked_gradient_of_one_token():
    """One token over a 3-word vocabulary, z = h W^T: d log p_y / dz = onehot(y) - p and
    dH/dz_v = -p_v (log p_v + H), pushed through z = h W^T by hand."""
    hidden = torch.tensor([[1.0, -1.0]], requires_grad=True)
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.5, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    # z = [0.5, -1, 0]; chunk 1 < 2 tokens forces the chunked path on a 2-token batch
    h2 = torch.cat([hidden, hidden])
    logp, ent = token_log_probs_and_entropy(h2, head, torch.tensor([0, 0]), 1.0, chunk=1)
    (logp[0] + ent[1]).backward()
    z = torch.tensor([0.5, -1.0, 0.0])
    p = torch.softmax(z, 0)
    big_h = float(-(p * p.log()).sum())
    assert logp[0].item() == pytest.approx(float(torch.log_softmax(z, 0)[0]), abs=1e-6)
    assert ent[1].item() == pytest.approx(big_h, abs=1e-6)
    g_z = (torch.tensor([1.0, 0.0, 0.0]) - p) + (-p * (p.log() + big_h))
    want_h = g_z @ head.weight.detach()
    torch.testing.assert_close(hidden.grad[0], want_h, atol=1e-6, rtol=0)
    torch.testing.assert_close(head.weight.grad, g_z[:, None] * hidden.detach()[0][None, :], atol=1e-6, rtol=0)


def test_no_grad_log_probs_in_chunks():
    hidden, head, labels, _, _ = setup(torch.float32)
    with torch.no_grad():
        whole = token_log_probs(hidden, head, labels, 0.7)
        chunked = token_log_probs(hidden, head, labels, 0.7, chunk=5)
        ref, _ = log_probs_and_entropy(head(hidden), labels, 0.7)
    # |log p| is 16 to 64 here, so 1e-6 relative is ~8 float32 ulps: room for a logsumexp over 300
    # logits summed in another order, far below any real difference
    torch.testing.assert_close(chunked, whole, atol=0, rtol=1e-6)
    torch.testing.assert_close(whole, ref, atol=0, rtol=1e-6)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_gradients_stay_on_the_weights_device(entropy_grad):
    """The backward makes the projection's gradient where the weight lives (a GPU in training).
    On the `meta` device here: a gradient made on the default device is refused by autograd."""
    hidden = torch.randn(10, 16, device="meta", requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False, device="meta")
    labels = torch.zeros(10, dtype=torch.long, device="meta")
    logp, ent = token_log_probs_and_entropy(hidden, head, labels, 0.7, chunk=4, entropy_grad=entropy_grad)
    (logp.sum() + ent.sum()).backward()
    assert head.weight.grad.device.type == "meta" and head.weight.grad.shape == (50, 16)
    assert hidden.grad.device.type == "meta" and hidden.grad.shape == (10, 16)


@pytest.mark.parametrize("chunk", [8, 64])
def test_the_graph_keeps_no_logits(chunk):
    """What autograd keeps for the backward: the hidden states, the weight, the labels and the
    entropies, never a [tokens, vocabulary] tensor, even when all tokens fit one chunk."""
    hidden, head, labels, w_lp, w_ent = setup(torch.float32)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = token_log_probs_and_entropy(hidden, head, labels, 0.7, chunk)
    assert sorted(saved) == sorted([(37,), (37,), (37, 16), (300, 16)])
    (logp * w_lp + ent * w_ent).sum().backward()
    assert hidden.grad.shape == (37, 16)
