"""The EAGLE-3 draft model and the alignment its training-time test (TTT) trains (tasks/train/ttt.py: batches, teacher, loss).

Owns `DraftConfig` (the draft's shape, derived from any Llama- or DeepSeek-V3/Kimi-shaped target
config), `Eagle3Draft` (frozen target embeddings, `fc` 3H -> H, one Llama decoder layer whose
q/k/v read `cat([input_layernorm(embeds), hidden_norm(hidden)])` with the raw hidden as residual,
`norm`, `lm_head` over the draft vocab, `d2t`/`t2d` buffers) and the TTT attention. The batches,
the teacher and the loss that train it live in tasks/train/ttt.py.

Promises, in one place each:
- Alignment (tasks/extract/hf_backend.py: position t holds the states after reading token t). TTT step i at
  position t reads `embed(token[t+i+1])` and, at step 0, `fc(aux[t])` (later steps: the draft's
  own pre-norm output of step i-1 at t); it predicts token t+i+2, whose teacher is the target's
  distribution at position t+i+1. A prediction counts when token t+i+2 is loss-masked (the
  record's loss_mask is per token) and the target's full-vocab argmax at t+i+1 lies in the draft
  vocab (CONTRACTS: such positions are masked).
- Attention at step i, query t: step-0 keys s <= t of the same sample, plus the keys of steps
  1..i at position t only (the "diagonal" cache). RoPE position of step i is t+i, the position
  the draft token occupies at serving time. `ttt_attention_mask` states this as a dense mask;
  `ttt_attention` computes it with a fused flash kernel for the step-0 block (its logsumexp
  merged with the diagonal scores), keeping nothing T x T for backward.
- A sample's logits and loss do not depend on what it is batched with (right padding; causal
  attention never reaches a padded key from a real query).
- Loss: forward KL as soft cross entropy over the draft vocab, mean over counted positions per
  step, steps weighted decay**i (0.8 as in EAGLE-3/SpecForge). The teacher is float32.
- No python loop over positions: the TTT steps (k <= ~8) are the only loop in the model; the
  teacher is computed in chunks of positions only to bound memory on 160K-vocab targets. The
  loss needs the teacher, the head and the soft cross entropy only at counted positions, and
  computes them only there (the same numbers as over all positions, masked).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from tasks.extract.hf_backend import validate_aux_layer_ids

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedModel

Teacher = Literal["final_hidden", "topk"]
DEFAULT_TTT_STEPS = 7
DEFAULT_STEP_DECAY = 0.8


# ---------------------------------------------------------------- configuration

def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rope_from(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None for plain RoPE) from a transformers 5.x or 4.x style config."""
    params = _get(cfg, "rope_parameters")
    if isinstance(params, Mapping) and params:
        theta = params.get("rope_theta", _get(cfg, "rope_theta"))
        scaling: Mapping[str, Any] | None = params
    else:
        theta = _get(cfg, "rope_theta")
        scaling = _get(cfg, "rope_scaling")
    return (10000.0 if theta is None else float(theta)), _normalise_rope_scaling(scaling)


def _normalise_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The scaling dict with one `rope_type` key and no `rope_theta`; None for plain RoPE."""
    if not scaling:
        return None
    out = {k: v for k, v in dict(scaling).items() if k not in ("rope_theta", "type")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    out["rope_type"] = rope_type
    return out


@dataclass(frozen=True)
class DraftConfig:
    """The draft's shape. `aux_layer_ids` are project convention: output of decoder layer i, 0-based."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    hidden_act: str
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_num_layers: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        object.__setattr__(self, "rope_scaling", _normalise_rope_scaling(self.rope_scaling))
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings", "target_vocab_size", "draft_vocab_size", "target_num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DraftConfig.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DraftConfig.num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"DraftConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"DraftConfig.rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"DraftConfig.rope_theta must be positive, got {self.rope_theta}")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"DraftConfig.draft_vocab_size={self.draft_vocab_size} exceeds "
                             f"target_vocab_size={self.target_vocab_size}")
        from transformers.activations import ACT2FN

        if self.hidden_act not in ACT2FN:
            raise ValueError(f"DraftConfig.hidden_act {self.hidden_act!r} is not a transformers activation")
        try:
            validate_aux_layer_ids(list(self.aux_layer_ids), self.target_num_layers)
        except ValueError as e:
            raise ValueError(f"DraftConfig.aux_layer_ids: {e}") from None
        try:
            rope_inv_freq(self)
        except Exception as e:  # noqa: BLE001 - any failure here means the rope settings are unusable
            raise ValueError(f"DraftConfig.rope_scaling {self.rope_scaling!r} cannot be computed: {e}") from None

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """transformers 5.x style: rope_type, rope_theta and the scaling fields in one dict."""
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    @classmethod
    def from_target_config(cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: Sequence[int],
                           **overrides: Any) -> DraftConfig:
        """The draft for `target_config` (a transformers config or its dict; multimodal wrappers use their text config).

        The draft layer is a plain Llama layer whatever the target's attention: an MLA target
        (DeepSeek-V3, Kimi) has a `head_dim` that describes its rope part only, so the draft uses
        hidden_size // heads there; absent kv heads mean as many as heads. `overrides` replace any
        field (e.g. a smaller intermediate_size, or another rope setting for the draft).
        """
        if not isinstance(target_config, Mapping) and hasattr(target_config, "get_text_config"):
            target_config = target_config.get_text_config()
        hidden = _get(target_config, "hidden_size")
        heads = _get(target_config, "num_attention_heads")
        layers = _get(target_config, "num_hidden_layers")
        vocab = _get(target_config, "vocab_size")
        for name, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_hidden_layers", layers),
                            ("vocab_size", vocab)):
            if value is None:
                raise ValueError(f"target config has no {name}")
        is_mla = _get(target_config, "kv_lora_rank") is not None
        head_dim = None if is_mla else _get(target_config, "head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"target hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
                                 "pass head_dim=... for the draft")
            head_dim = hidden // heads
        theta, scaling = _rope_from(target_config)
        fields: dict[str, Any] = {
            "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": _get(target_config, "num_key_value_heads") or heads,
            "head_dim": head_dim, "intermediate_size": _get(target_config, "intermediate_size"),
            "rms_norm_eps": float(_get(target_config, "rms_norm_eps", 1e-6)),
            "rope_theta": theta, "rope_scaling": scaling,
            "max_position_embeddings": _get(target_config, "max_position_embeddings", 4096),
            "hidden_act": _get(target_config, "hidden_act", "silu"), "target_vocab_size": vocab,
            "draft_vocab_size": draft_vocab_size, "aux_layer_ids": tuple(aux_layer_ids), "target_num_layers": layers,
        }
        unknown = set(overrides) - set(fields)
        if unknown:
            raise ValueError(f"unknown DraftConfig fields in overrides: {sorted(unknown)}")
        fields.update(overrides)
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DraftConfig:
        return cls(**d)

    def llama_config(self) -> LlamaConfig:
        """The draft layer as a transformers LlamaConfig (rope computations, interop)."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
                           rope_parameters=self.rope_parameters, max_position_embeddings=self.max_position_embeddings,
                           hidden_act=self.hidden_act, vocab_size=self.target_vocab_size, num_hidden_layers=1,
                           tie_word_embeddings=False)


def rope_inv_freq(config: DraftConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2], cos/sin scale) for the draft's rope settings.

    Plain RoPE is computed here; scaled variants use transformers' own initialisers, so a yarn or
    llama3 target gives the draft the frequencies transformers (and SGLang, which follows the
    same formulas) computes. Frequencies are static: positions beyond max_position_embeddings do
    not re-scale ("dynamic" rope is computed at its initial length).
    """
    if config.rope_scaling is None:
        dim = config.head_dim
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = config.rope_scaling["rope_type"]
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r} (known: default, {', '.join(ROPE_INIT_FUNCTIONS)})")
    import logging

    # transformers warns about yarn factors it finds inconsistent; the target's own settings are
    # what the server uses, so the draft keeps them as they are.
    logger = logging.getLogger("transformers.modeling_rope_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config.llama_config())
    finally:
        logger.setLevel(level)
    return inv_freq.float(), float(scale)


# ---------------------------------------------------------------- the model

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the input dtype, as Llama does; scale in the input dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


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
    block given as such (tasks/evaluate/offline.py passes its causal mask). Later steps contribute one
    score per query (its own position). The step-0 block runs through a fused flash kernel on CPU (a dense
    float32 path elsewhere); the diagonal scores and the merge are float32.
    """
    bias, causal = _step0_bias(attention_mask, q.dtype)
    cached: list[torch.Tensor] = []
    for k, v in zip(keys[1:], values[1:]):
        cached += [k, v]
    return _TTTAttention.apply(q, bias, causal, keys[0], values[0], *cached)


class Eagle3Attention(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        # q/k/v read the concatenation [embeds, hidden]: 2H inputs (the EAGLE-3 midlayer).
        self.q_proj = nn.Linear(2 * h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]], attention_mask: torch.Tensor | None) -> torch.Tensor:
        """attention_mask: bool [B, T] real tokens, or a [B, T, T] step-0 mask (see `ttt_attention`)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.append((k, v))
        out = ttt_attention(q, [c[0] for c in cache], [c[1] for c in cache], attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The midlayer. Names match SGLang's LlamaForCausalLMEagle3 (`midlayer.*`) one to one."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]], attention_mask: torch.Tensor | None) -> torch.Tensor:
        # The residual is the raw hidden state, not the embedding and not its normed copy: SGLang
        # (and vLLM with norm_before_residual=false) serve exactly this.
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = residual + self.self_attn(x, cos, sin, cache, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def _shift_left(x: torch.Tensor, n: int, fill: float | bool = 0) -> torch.Tensor:
    """x[:, t+n] at t (dim 1), `fill` past the end."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        # The target's embeddings, frozen: the server copies them from the target, so training
        # must never move them.
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.target_vocab_size, dtype=torch.bool))
        # A plain float32 attribute, not a buffer: `draft.to(torch.bfloat16)` must not round the
        # rope frequencies (positions in the thousands would drift).
        self.rope_inv_freq, self.rope_scale = rope_inv_freq(config)

    # -- vocabulary
    def set_vocab(self, d2t: torch.Tensor | np.ndarray, t2d: torch.Tensor | np.ndarray) -> None:
        """Install `d2t` offsets and the `t2d` mask after checking them (tasks.extract.vocab.validate_vocab)."""
        from tasks.extract.vocab import validate_vocab

        d2t_np, t2d_np = np.asarray(torch.as_tensor(d2t).cpu()), np.asarray(torch.as_tensor(t2d).cpu())
        problems = validate_vocab(d2t_np, t2d_np, self.config.target_vocab_size, self.config.draft_vocab_size)
        if problems:
            raise ValueError("invalid draft vocab:\n" + "\n".join(problems))
        self.d2t.copy_(torch.as_tensor(d2t_np))
        self.t2d.copy_(torch.as_tensor(t2d_np))

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of each draft id (what SGLang calls hot_token_id)."""
        return self.d2t + torch.arange(self.config.draft_vocab_size, device=self.d2t.device)

    def target_to_draft(self) -> torch.Tensor:
        """Draft id of each target id, -1 outside the draft vocab."""
        out = torch.full((self.config.target_vocab_size,), -1, dtype=torch.int64, device=self.d2t.device)
        out[self.draft_to_target] = torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        return out

    # -- forward
    def _rope(self, length: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.fc.weight.device
        pos = torch.arange(offset, offset + length, device=device, dtype=torch.float32)
        freqs = pos[:, None] * self.rope_inv_freq.to(device)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    def hidden_steps(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None, steps: int = DEFAULT_TTT_STEPS
                     ) -> Iterator[torch.Tensor]:
        """Yield the pre-norm hidden [B, T, H] of TTT steps 0..steps-1 (no logits: a loss may need few rows).

        aux_hidden [B, T, 3H] and input_ids [B, T] are record-aligned (not shifted): the shifting
        described in the module docstring happens here.
        """
        b, t = input_ids.shape
        if aux_hidden.shape[:2] != (b, t) or aux_hidden.shape[-1] != 3 * self.config.hidden_size:
            raise ValueError(f"aux_hidden must be [B, T, 3H] = [{b}, {t}, {3 * self.config.hidden_size}], "
                             f"got {list(aux_hidden.shape)}")
        mask = None if attention_mask is None else attention_mask.bool()
        hidden = self.fc(aux_hidden.to(self.fc.weight.dtype))
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(steps):
            embeds = self.embed_tokens(_shift_left(input_ids, i + 1))
            cos, sin = self._rope(t, i)  # the step-i draft token sits at position t+i when served
            hidden = self.midlayer(embeds, hidden, cos, sin, cache, mask)
            yield hidden

    def steps(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              steps: int = DEFAULT_TTT_STEPS) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (pre-norm hidden [B, T, H], logits [B, T, draft_vocab]) for TTT steps 0..steps-1.

        A generator, so a loss can be taken per step without keeping every step's logits alive.
        """
        for hidden in self.hidden_steps(aux_hidden, input_ids, attention_mask, steps):
            yield hidden, self.lm_head(self.norm(hidden))

    def forward(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                steps: int = 1) -> list[torch.Tensor]:
        """Logits [B, T, draft_vocab] of each TTT step (step 0 alone by default)."""
        return [logits for _, logits in self.steps(aux_hidden, input_ids, attention_mask, steps)]


def load_target_embeddings(draft: Eagle3Draft, target_model: PreTrainedModel | nn.Module | torch.Tensor) -> None:
    """Copy the target's input embeddings into the draft's frozen `embed_tokens`."""
    weight = target_model if isinstance(target_model, torch.Tensor) else target_model.get_input_embeddings().weight
    expected = (draft.config.target_vocab_size, draft.config.hidden_size)
    if tuple(weight.shape) != expected:
        raise ValueError(f"target embeddings have shape {tuple(weight.shape)}, the draft expects {expected} "
                         "(target_vocab_size, hidden_size)")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(weight.detach().to(draft.embed_tokens.weight.dtype))
    draft.embed_tokens.weight.requires_grad_(False)


def init_head_from_target(draft: Eagle3Draft, head_weight: torch.Tensor, final_norm_weight: torch.Tensor) -> None:
    """Start the draft's `lm_head` and `norm` from the target's: head rows of the draft vocab, the final norm.

    The draft's head is its largest trained matrix (draft_vocab x H) and, from random, learns a row
    only from the positions whose teacher puts mass on that token: with tens of thousands of
    training tokens most rows see almost none. The target's own rows already map a target-like
    final state to its tokens, which is what the draft's last hidden is trained to become (its
    teacher is the target's distribution). Call after `set_vocab` (the rows are chosen by d2t).
    Measured on SmolLM2 it trains worse than a random head (benchmarks/README, "selection"): behind a
    random `fc` and midlayer, the target's sharp head starts confidently wrong.
    """
    v, h = draft.config.target_vocab_size, draft.config.hidden_size
    if tuple(head_weight.shape) != (v, h):
        raise ValueError(f"target head has shape {tuple(head_weight.shape)}, the draft expects {(v, h)} "
                         "(target_vocab_size, hidden_size)")
    if tuple(final_norm_weight.shape) != (h,):
        raise ValueError(f"target final norm has shape {tuple(final_norm_weight.shape)}, the draft expects {(h,)}")
    rows = draft.draft_to_target
    if not bool(draft.t2d[rows].all()) or int(draft.t2d.sum()) != draft.config.draft_vocab_size:
        raise ValueError("the draft vocab is not set (call set_vocab before init_head_from_target)")
    with torch.no_grad():
        draft.lm_head.weight.copy_(head_weight.detach()[rows.to(head_weight.device)].to(draft.lm_head.weight))
        draft.norm.weight.copy_(final_norm_weight.detach().to(draft.norm.weight))


def target_final_norm_weight(target_model: PreTrainedModel | nn.Module) -> torch.Tensor:
    """The weight of the target's final RMSNorm, the one its lm_head reads (Llama and DeepSeek-V3 layouts)."""
    prefix = getattr(target_model, "base_model_prefix", "model")
    norm = getattr(getattr(target_model, prefix, None), "norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        raise ValueError(f"{type(target_model).__name__} has no final norm at .{prefix}.norm: "
                         "train.init: target_head needs it")
    return norm.weight.detach()


def target_head_weight(target_model: PreTrainedModel | nn.Module) -> torch.Tensor:
    """The target's lm_head weight [V, H]: the final_hidden teacher's projection (tied models: the embeddings)."""
    return target_model.get_output_embeddings().weight.detach()
