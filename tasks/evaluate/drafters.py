"""Drafters for offline acceptance: what proposes the tokens a verify round checks.

Owns `TargetState` (what a drafter may read), the `Drafter` protocol and its kinds: the EAGLE-3
draft (`Eagle3Drafter`; hidden="final" is the same draft fed only the final state, as
`--speculative-algorithm EAGLE` serves it), prompt lookup, and an oracle (the target itself).

Promises:
- EAGLE-3 drafting is the serving recurrence TTT trains (SGLang's draft extend + decode): step 0
  runs the midlayer over every committed position t (embed(token[t+1]), fc(aux[t]), RoPE t),
  whose keys are the context cache; step j >= 1 runs at the last position only on embed(proposal
  j-1) and step j-1's pre-norm hidden, RoPE last+j, attending the context keys and its own steps.
- Recomputed for simplicity: the draft's step 0 over the whole context each round (one layer;
  a position's key depends only on its own token and aux state, so this equals an incremental
  draft cache).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from tasks.model.draft import Eagle3Draft


@dataclass(frozen=True)
class TargetState:
    """What a drafter may read before a verify round.

    `tokens` [n] is the prompt plus every committed token; its last one (the newest, the previous
    round's bonus) has no target state yet. `hidden_states` is transformers' tuple (embeddings,
    output of each layer, post-norm final), each [n-1, H], for positions 0..n-2: position t holds
    the states after reading token t.
    """

    tokens: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to k target token ids to follow `state.tokens` (fewer, even none, is allowed)."""

    name: str

    def propose(self, state: TargetState, k: int) -> list[int]: ...


class OracleDrafter:
    """The target's own greedy continuation: every proposal is accepted (a known-answer check)."""

    def __init__(self, target: PreTrainedModel, name: str = "oracle") -> None:
        self.target, self.name = target, name

    @torch.inference_mode()
    def propose(self, state: TargetState, k: int) -> list[int]:
        x = state.tokens.to(self.target.device)
        out: list[int] = []
        for _ in range(k):
            token = int(self.target(input_ids=x[None]).logits[0, -1].argmax())
            out.append(token)
            x = torch.cat([x, x.new_tensor([token])])
        return out


class PromptLookupDrafter:
    """Prompt-lookup (n-gram) drafting, no model: the k tokens after an earlier occurrence of the last n tokens.

    n runs from `max_ngram` down to `min_ngram`; the most recent earlier occurrence with a
    non-empty continuation wins (as vLLM's n-gram proposer; transformers takes the earliest).
    No match proposes nothing, and the round is a plain decode step.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "prompt-lookup") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name

    def propose(self, state: TargetState, k: int) -> list[int]:
        tokens = state.tokens.tolist()
        n_tokens = len(tokens)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            # Start positions of earlier occurrences, newest first; the tail itself is excluded.
            for start in range(n_tokens - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []


def draft_chain_logits(draft: Eagle3Draft, fused_hidden: torch.Tensor, tokens: torch.Tensor, k: int,
                       forced: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Draft-vocab logits of steps 0..k-1 at the last context position (see the module docstring).

    fused_hidden [T, H]: the step-0 hidden of positions 0..T-1 (fc(aux), or the final state for the
    EAGLE-flag baseline); tokens [T+1]: the context, its last token the newest. Step j >= 1 reads
    the target id `forced[j-1]` when given (teacher forcing, to compare with `Eagle3Draft.steps`),
    else the target id of step j-1's argmax.
    """
    from tasks.model.draft import rotate_half

    layer, attn = draft.midlayer, draft.midlayer.self_attn
    t = fused_hidden.shape[0]
    if tokens.shape[0] != t + 1:
        raise ValueError(f"tokens must be one longer than fused_hidden: {tokens.shape[0]} vs {t}")
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    tokens = tokens.to(device)
    to_target = draft.draft_to_target
    # Step 0 over the whole context with the model's own layer: its cache holds the context keys.
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None]
    cos, sin = draft._rope(t, 0)
    hidden = layer(draft.embed_tokens(tokens[1:])[None], fused_hidden.to(device, dtype)[None], cos, sin, cache,
                   causal)[:, -1:]
    logits = [draft.lm_head(draft.norm(hidden))[0, 0]]
    hidden = draft.next_hidden(hidden)
    keys, values = [cache[0][0]], [cache[0][1]]
    nh, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    scale = 1.0 / math.sqrt(hd)
    for j in range(1, k):
        token = int(forced[j - 1]) if forced is not None else int(to_target[logits[-1].argmax()])
        embeds = draft.embed_tokens(torch.tensor([[token]], device=device))
        cos, sin = draft._rope(1, t - 1 + j)  # the step-j draft token sits at position (last + j)
        cos, sin = cos.to(dtype), sin.to(dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(1, 1, nh, hd).transpose(1, 2)
        kj = attn.k_proj(x).view(1, 1, kvh, hd).transpose(1, 2)
        vj = attn.v_proj(x).view(1, 1, kvh, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        kj = kj * cos + rotate_half(kj) * sin
        keys.append(kj)
        values.append(vj)
        kk, vv = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # [1, kvh, t + j, hd]
        qg = q.view(1, kvh, nh // kvh, 1, hd)
        # float32 scores and softmax, as the training attention computes them
        w = (torch.matmul(qg, kk.unsqueeze(2).transpose(-1, -2)).float() * scale).softmax(-1).to(q.dtype)
        out = torch.matmul(w, vv.unsqueeze(2)).view(1, nh, 1, hd).transpose(1, 2).reshape(1, 1, nh * hd)
        h = hidden + attn.o_proj(out)  # the residual is the raw hidden, as in the midlayer
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        logits.append(draft.lm_head(draft.norm(out))[0, 0])
        hidden = draft.next_hidden(out)
    return logits


class Eagle3Drafter:
    """An EAGLE-3 draft proposing a greedy chain.

    hidden="aux" is EAGLE-3 as served with `--speculative-algorithm EAGLE3`: fc over the three aux
    layers (project convention: id i = hidden_states[i+1]). hidden="final" is what the same draft
    gets under `--speculative-algorithm EAGLE`: the target's H-dim final (post-norm) state, and
    SGLang's shape test then skips fc, so that state goes straight in where fc's output would.
    """

    def __init__(self, draft: Eagle3Draft, hidden: Literal["aux", "final"] = "aux", name: str | None = None) -> None:
        if hidden not in ("aux", "final"):
            raise ValueError(f"hidden must be 'aux' or 'final', got {hidden!r}")
        self.draft, self.hidden = draft.eval(), hidden
        self.name = name or ("eagle3" if hidden == "aux" else "eagle3-final-state-only")

    @torch.inference_mode()
    def propose(self, state: TargetState, k: int) -> list[int]:
        draft = self.draft
        dtype = draft.fc.weight.dtype
        if self.hidden == "aux":
            aux = torch.cat([state.hidden_states[i + 1] for i in draft.config.aux_layer_ids], dim=-1)
            fused = draft.fuse(aux.to(draft.fc.weight.device, dtype))
        else:
            fused = state.hidden_states[-1]
        logits = draft_chain_logits(draft, fused, state.tokens, k)
        return [int(draft.draft_to_target[step.argmax()]) for step in logits]


def standard_drafters(draft: Eagle3Draft, baselines: bool = True) -> list[Drafter]:
    """The draft under test, then (labelled) the same draft fed only the final state, then prompt lookup."""
    drafters: list[Drafter] = [Eagle3Drafter(draft, "aux")]
    if baselines:
        drafters += [Eagle3Drafter(draft, "final"), PromptLookupDrafter()]
    return drafters
