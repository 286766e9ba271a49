"""The TTT attention kernel: one query step over the draft's training-time-test cache, forward and backward.

Owns `ttt_attention` (what `Eagle3Attention` in tasks/model/draft.py calls) and `ttt_attention_mask`
(the same rule as a dense mask, the statement tests check the kernel against).

Promises:
- Attention at step i, query t: step-0 keys s <= t of the same sample, plus the keys of steps
  1..i at position t only (the "diagonal" cache); padded keys are never reached from a real query.
- The step-0 block runs through a fused flash kernel (`FUSED_ATTENTION_DEVICES`) whose
  logsumexp is merged with the diagonal scores in float32; nothing T x T is kept for backward.
  Elsewhere a dense float32 path computes the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def ttt_attention_mask(attention_mask: torch.Tensor, step: int) -> torch.Tensor:
    """The dense TTT mask at `step`: bool [B, T, T*(step+1)], True where query t may attend.

    Keys are laid out step by step (step 0's T keys, then step 1's, ...). Query t sees step-0 key
    s when s <= t and s is a real token of its sample, and for each later step j in 1..step only
    the key at its own position t. The model never builds this mask (it computes the same thing
    in O(T^2 + T*step)); it is the statement tests check the attention against.
    """
    b, t = attention_mask.shape
    real = attention_mask.bool()
    causal = torch.ones(t, t, dtype=torch.bool, device=real.device).tril()
    blocks = [causal[None] & real[:, None, :]]
    eye = torch.eye(t, dtype=torch.bool, device=real.device)
    blocks += [eye[None].expand(b, t, t)] * step
    return torch.cat(blocks, dim=-1)


# Devices whose fused flash-attention kernel (with logsumexp and a backward that takes it) the TTT
# attention uses for the step-0 block; elsewhere a dense float32 path computes the same thing.
FUSED_ATTENTION_DEVICES = ("cpu",)


def _step0_bias(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
    """(additive bias, causal) for the step-0 block.

    A [B, T] mask of real tokens gives a key-padding bias [B, 1, 1, T] (0 on real keys, -inf on
    padding; None without padding) on top of the causal mask. A [B, T, T] mask is the step-0 block
    itself (as `ttt_attention_mask(mask, 0)` or another caller's own): a bias [B, 1, T, T], not causal.
    """
    if attention_mask is None:
        return None, True
    if attention_mask.dim() == 3:
        bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
        return bias.masked_fill(~attention_mask.bool(), float("-inf"))[:, None], False
    if bool(attention_mask.all()):
        return None, True
    bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill(~attention_mask.bool(), float("-inf"))[:, None, None], True


def _dense_step0(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scale: float,
                 causal: bool) -> torch.Tensor:
    """float32 step-0 scores [B, nh, T, T] with the mask applied (the portable path)."""
    t = q.shape[-2]
    g = q.shape[1] // k.shape[1]
    s = torch.matmul(q.float(), k.float().repeat_interleave(g, dim=1).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return s if bias is None else s + bias.float()


def _step0_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(S) V [B, nh, T, d], logsumexp of S [B, nh, T] float32) of the step-0 causal block."""
    if q.device.type in FUSED_ATTENTION_DEVICES:  # fused flash kernel: no T x T scores, skips the masked half
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse
    s = _dense_step0(q, k, bias, scale, causal)
    lse = s.logsumexp(-1)
    g = q.shape[1] // k.shape[1]
    out = torch.matmul((s - lse[..., None]).exp().to(v.dtype), v.repeat_interleave(g, dim=1))
    return out, lse


def _step0_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, bias: torch.Tensor | None, scale: float, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the step-0 block given the *merged* output and logsumexp (flash-attention backward)."""
    if q.device.type in FUSED_ATTENTION_DEVICES:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    b, nh, t, d = q.shape
    kvh, g = k.shape[1], q.shape[1] // k.shape[1]
    p = (_dense_step0(q, k, bias, scale, causal) - lse[..., None]).exp()  # [B, nh, T, T] float32
    do = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), do).view(b, kvh, g, t, d).sum(2)
    dp = torch.matmul(do, v.float().repeat_interleave(g, dim=1).transpose(-1, -2))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, k.float().repeat_interleave(g, dim=1))
    dk = torch.matmul(ds.transpose(-1, -2), q.float()).view(b, kvh, g, t, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TTTAttention(torch.autograd.Function):
    """softmax over [step-0 causal block | one diagonal score per cached step] in one function.

    Forward: the step-0 block through a fused kernel that also returns its logsumexp, merged with
    the diagonal scores by log-sum-exp. Backward: the step-0 block's gradient is the fused kernel's
    backward called with the *merged* output and logsumexp (its probabilities exp(S - lse) are then
    the merged softmax's, and rowsum(dO * O) is the merged one), plus the diagonal terms in closed
    form. Saved for backward: q, k, v, the output and logsumexp, O(T) per head; no T x T tensor.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, bias: torch.Tensor | None, causal: bool, k0: torch.Tensor, v0: torch.Tensor,
                *cached: torch.Tensor) -> torch.Tensor:
        b, nh, t, d = q.shape
        kvh = k0.shape[1]
        g = nh // kvh
        scale = 1.0 / math.sqrt(d)
        with torch.autocast(q.device.type, enabled=False):
            o0, lse0 = _step0_forward(q, k0, v0, bias, scale, causal)
            ctx.scale, ctx.causal, ctx.n, ctx.dtypes = scale, causal, len(cached) // 2, [c.dtype for c in cached]
            if not cached:
                ctx.save_for_backward(q, k0, v0, o0, lse0, bias)
                return o0
            qg = q.float().view(b, kvh, g, t, d)
            ks = torch.stack([c.float() for c in cached[0::2]])  # [n, B, kvh, T, d]
            vs = torch.stack([c.float() for c in cached[1::2]])
            s = torch.einsum("bkgtd,nbktd->nbkgt", qg, ks) * scale  # the diagonal scores, float32
            lse0 = lse0.float().view(b, kvh, g, t)
            lse = torch.logaddexp(lse0, s.logsumexp(0))
            p = (s - lse).exp()  # [n, B, kvh, g, T]
            out = o0.float().view(b, kvh, g, t, d) * (lse0 - lse).exp()[..., None]
            out = (out + torch.einsum("nbkgt,nbktd->bkgtd", p, vs)).view(b, nh, t, d).to(q.dtype)
            ctx.save_for_backward(q, k0, v0, out, lse.view(b, nh, t), bias, ks, vs, p)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        dout = dout.contiguous()
        with torch.autocast(dout.device.type, enabled=False):
            if ctx.n == 0:
                q, k0, v0, o0, lse0, bias = ctx.saved_tensors
                dq, dk0, dv0 = _step0_backward(dout.to(q.dtype), q, k0, v0, o0, lse0, bias, ctx.scale, ctx.causal)
                return dq, None, None, dk0, dv0
            q, k0, v0, out, lse, bias, ks, vs, p = ctx.saved_tensors
            b, nh, t, d = q.shape
            kvh = k0.shape[1]
            g = nh // kvh
            dq, dk0, dv0 = _step0_backward(dout.to(q.dtype), q, k0, v0, out, lse, bias, ctx.scale, ctx.causal)
            do = dout.float().view(b, kvh, g, t, d)
            rowsum = (do * out.float().view(b, kvh, g, t, d)).sum(-1)  # [B, kvh, g, T]
            dvs = torch.einsum("nbkgt,bkgtd->nbktd", p, do)
            ds = p * (torch.einsum("bkgtd,nbktd->nbkgt", do, vs) - rowsum) * ctx.scale
            dq = (dq.float() + torch.einsum("nbkgt,nbktd->bkgtd", ds, ks).reshape(b, nh, t, d)).to(q.dtype)
            dks = torch.einsum("nbkgt,bkgtd->nbktd", ds, q.float().view(b, kvh, g, t, d))
            grads: list[torch.Tensor] = []
            for j in range(ctx.n):
                grads += [dks[j].to(ctx.dtypes[2 * j]), dvs[j].to(ctx.dtypes[2 * j + 1])]
        return (dq, None, None, dk0, dv0, *grads)


def ttt_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries q [B, nh, T, d] over the TTT cache; returns [B, nh, T, d].

    keys/values: one [B, kvh, T, d] tensor per step so far (this step's included, last).
    attention_mask: bool [B, T], real tokens (None: all real): the step-0 block is causal over the
    sample's real keys (the step-0 block of `ttt_attention_mask`); or bool [B, T, T], the step-0
    block given as such (tasks/evaluate/drafters.py passes its causal mask). Later steps contribute one
    score per query (its own position). The step-0 block runs through a fused flash kernel on CPU (a dense
    float32 path elsewhere); the diagonal scores and the merge are float32.
    """
    bias, causal = _step0_bias(attention_mask, q.dtype)
    cached: list[torch.Tensor] = []
    for k, v in zip(keys[1:], values[1:]):
        cached += [k, v]
    return _TTTAttention.apply(q, bias, causal, keys[0], values[0], *cached)
