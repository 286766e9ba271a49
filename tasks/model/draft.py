"""The EAGLE-3 draft model and the alignment its training-time test (TTT) trains (tasks/train/ttt.py: batches, teacher, loss).

Owns `DraftConfig` (the draft's shape, derived from any Llama- or DeepSeek-V3/Kimi-shaped target
config), `Eagle3Draft` (frozen target embeddings, `fc` 3H -> H, one Llama decoder layer whose
q/k/v read `cat([input_layernorm(embeds), hidden_norm(hidden)])` with the raw hidden as residual,
`norm`, `lm_head` over the draft vocab, `d2t`/`t2d` buffers). The attention kernel its layer calls
is tasks/model/attention.py; the batches, the teacher and the loss that train it live in
tasks/train/ttt.py.

Promises, in one place each:
- Alignment (tasks/extract/hf_backend.py: position t holds the states after reading token t). TTT step i at
  position t reads `embed(token[t+i+1])` and, at step 0, `fc(aux[t])` (later steps: the draft's
  own pre-norm output of step i-1 at t); it predicts token t+i+2, whose teacher is the target's
  distribution at position t+i+1. A prediction counts when token t+i+2 is loss-masked (the
  record's loss_mask is per token) and the target's full-vocab argmax at t+i+1 lies in the draft
  vocab (docs/contracts.md: such positions are masked).
- Attention at step i, query t: step-0 keys s <= t of the same sample, plus the keys of steps
  1..i at position t only (the "diagonal" cache). RoPE position of step i is t+i, the position
  the draft token occupies at serving time. tasks/model/attention.py states this as a dense mask
  (`ttt_attention_mask`) and computes it (`ttt_attention`) keeping nothing T x T for backward.
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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from tasks.extract.hf_backend import validate_aux_layer_ids
from tasks.model.attention import ttt_attention

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
    # "Eagle 3.1" (speculators' names, read by vLLM from a speculators config's top level): an RMSNorm over the
    # three concatenated aux states before fc (weight `input_norm.weight` [3H]), and the final norm's output,
    # not the raw hidden, handed to the next draft step. SGLang and llama.cpp have neither.
    norm_before_fc: bool = False
    norm_output: bool = False

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
            "norm_before_fc": False, "norm_output": False,
        }
        unknown = set(overrides) - set(fields)
        if unknown:
            raise ValueError(f"unknown DraftConfig fields in overrides: {sorted(unknown)}")
        fields.update(overrides)
        return cls(**fields)

    @property
    def eagle31_norms(self) -> list[str]:
        """The Eagle 3.1 options this draft uses, by their speculators names."""
        return [n for n in ("norm_before_fc", "norm_output") if getattr(self, n)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        for name in ("norm_before_fc", "norm_output"):  # absent when off: identities recorded before them still match
            if not d[name]:
                del d[name]
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's half rotation over the last dim: (a, b) -> (-b, a)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


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
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
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


def shift_left(x: torch.Tensor, n: int, fill: float | bool = 0) -> torch.Tensor:
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
        if config.norm_before_fc:
            self.input_norm = RMSNorm(3 * h, config.rms_norm_eps)
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
        hidden = self.fuse(aux_hidden)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(steps):
            embeds = self.embed_tokens(shift_left(input_ids, i + 1))
            cos, sin = self._rope(t, i)  # the step-i draft token sits at position t+i when served
            out = self.midlayer(embeds, hidden, cos, sin, cache, mask)
            yield out
            hidden = self.next_hidden(out)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc over the three aux states [.., 3H] -> [.., H] (normed first under norm_before_fc)."""
        x = aux_hidden.to(self.fc.weight.dtype)
        return self.fc(self.input_norm(x) if self.config.norm_before_fc else x)

    def next_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """What a draft step hands the next one: its pre-norm output, or the normed one under norm_output."""
        return self.norm(out) if self.config.norm_output else out

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
