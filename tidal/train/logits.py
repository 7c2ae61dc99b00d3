"""Log-probs and entropy of the sampled tokens straight from hidden states, in chunks of tokens, so
the [tokens, vocabulary] logits are never held whole.

With a 49k vocabulary, the logits of 4,096 response tokens are 800 MB in fp32, and autograd keeps
them, their log-softmax and its gradient alive together. `token_log_probs_and_entropy` computes
one chunk of logits at a time and keeps only the hidden states; backward computes each chunk's
logits again (one more output-projection matmul, about a third of its forward + backward cost),
in place where it can: two [chunk, V] buffers at a time.

For z = h W^T / tau, p = softmax(z), the sampled token y and the entropy H = -sum_v p_v log p_v:

    d log p_y / dz = onehot(y) - p
    d H / dz_v     = -p_v (log p_v + H)
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algo import log_probs_and_entropy, log_probs_from_logits


def _chunk_log_softmax(h: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """log softmax(h W^T / temperature) [n, V] in fp32 for one chunk of hidden states."""
    z = torch.nn.functional.linear(h, weight).float()
    if temperature != 1.0:
        z.div_(temperature)
    return torch.log_softmax(z, dim=-1)


def _entropy_into(log_p: Tensor, scratch: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v [n] of one chunk's log-softmax; `scratch` [n, V] ends holding
    p * log p. The log-softmax is clamped in place: a -inf log-prob (p = 0) contributes 0 * finite,
    not 0 * inf = NaN."""
    torch.exp(log_p, out=scratch)
    scratch.mul_(log_p.clamp_(min=torch.finfo(log_p.dtype).min))
    return scratch.sum(dim=-1).neg_()


class _ChunkedLogProbs(torch.autograd.Function):
    """Each chunk holds at most two [chunk, V] fp32 buffers at once, forward or backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, chunk: int):
        logp = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        ent = torch.empty_like(logp)
        for s in range(0, hidden.shape[0], chunk):
            log_p = _chunk_log_softmax(hidden[s : s + chunk], weight, temperature)
            logp[s : s + chunk] = log_p.gather(-1, labels[s : s + chunk, None])[:, 0]
            ent[s : s + chunk] = _entropy_into(log_p, torch.empty_like(log_p))
            del log_p
        ctx.save_for_backward(hidden, weight, labels, ent)
        ctx.set_materialize_grads(False)  # an output nobody differentiates sends None, not zeros
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        hidden, weight, labels, ent = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # on the weight's device: autograd runs this outside any default-device mode the caller set
        grad_w = weight.new_zeros(weight.shape, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h, rows = hidden[s : s + chunk], slice(s, s + chunk)
            log_p = _chunk_log_softmax(h, weight, tau)
            grad_z = log_p.exp()  # p
            if g_ent is not None:
                # dH/dz_v = -p_v (log p_v + H), built in log_p's buffer
                term = log_p.clamp_(min=torch.finfo(log_p.dtype).min).add_(ent[rows, None]).mul_(grad_z)
                term.mul_(g_ent[rows, None].float().neg())
            del log_p
            if g_logp is not None:  # d log p_y / dz = onehot(y) - p
                g = g_logp[rows].float()
                grad_z.mul_(g.neg()[:, None]).scatter_add_(-1, labels[rows, None], g[:, None])
                if g_ent is not None:
                    grad_z.add_(term)
            elif g_ent is not None:
                grad_z = term
            else:
                grad_z.zero_()
            if tau != 1.0:
                grad_z.div_(tau)
            grad_z = grad_z.to(hidden.dtype)
            if grad_h is not None:
                grad_h[rows] = grad_z @ weight
            if grad_w is not None:
                if grad_z.dtype == torch.float32:
                    grad_w.addmm_(grad_z.t(), h)
                else:
                    grad_w += (grad_z.t() @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


class SoftCappedHead(torch.nn.Module):
    """An output projection with final logit soft-capping (Gemma 2): z = c · tanh(head(h) / c)."""

    def __init__(self, head: torch.nn.Module, cap: float) -> None:
        super().__init__()
        self.head, self.cap = head, cap

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.head(hidden) / self.cap) * self.cap


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The module that turns `model`'s last hidden states into its logits: the output projection,
    soft-capped where the config says so (`final_logit_softcapping`, as the model's own forward
    does after the projection). A capped head has no `weight`, so its logits are computed whole."""
    head = model.get_output_embeddings()
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return SoftCappedHead(head, float(cap)) if cap else head


def token_log_probs_and_entropy(
    hidden: Tensor,
    head: torch.nn.Module,
    labels: Tensor,
    temperature: float = 1.0,
    chunk: int = 0,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """(log p(labels), entropy) [T] of softmax(head(hidden) / temperature) for hidden [T, H].

    With `chunk` > 0 and a bias-free linear `head`, the logits are computed `chunk` tokens at a
    time, kept by no graph and computed again in the backward (so even one chunk's worth is not held
    from the forward to the backward); otherwise in one piece, as `tidal.algo.log_probs_and_entropy`.
    Both give the same values and gradients."""
    weight = getattr(head, "weight", None)
    if chunk <= 0 or getattr(head, "bias", None) is not None or weight is None:
        return log_probs_and_entropy(head(hidden), labels, temperature, entropy_grad)
    logp, ent = _ChunkedLogProbs.apply(hidden, weight, labels.long(), float(temperature), chunk)
    return logp, ent if entropy_grad else ent.detach()


@torch.no_grad()
def token_log_probs(
    hidden: Tensor, head: torch.nn.Module, labels: Tensor, temperature: float = 1.0, chunk: int = 0
) -> Tensor:
    """log p(labels) [T] without a graph, `chunk` tokens of logits at a time (0: all at once)."""
    step = chunk if chunk > 0 else max(hidden.shape[0], 1)
    parts = [
        log_probs_from_logits(head(hidden[s : s + step]), labels[s : s + step], temperature)
        for s in range(0, hidden.shape[0], step)
    ]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
