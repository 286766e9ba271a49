"""Speculative decoding offline: the target's plain greedy decoding, and a drafter's chain verified against it.

Owns `GreedyPath` (one prompt's greedy decoding with every state a drafter may read),
`speculative_generate` (one request, one drafter, depth k), `RequestResult`, and the lossless check.

Promises:
- Lossless by construction, and checked: verification replays the target's plain greedy decoding
  (one token per forward, `greedy_path`), so every drafter's output is that decoding token for
  token, in any precision, on any CPU. Verifying k+1 proposals in one forward (as servers do, for
  speed) computes the same argmaxes only up to rounding, and in bf16 near-ties flip, so drafters
  were measured on different texts (benchmarks/offline_eval.py counts them). Every output is still
  compared with the plain decoding (and with a reference, when given): a difference is a
  `LossyDecoding` error naming the drafter, the prompt and the first differing position, never a
  number.
- Counting is SGLang's: the prefill gives the first token and is no verify round; a verify round
  checks the k proposals after the newest token, commits the longest prefix that matches the
  target's greedy tokens plus the bonus token (the target's next one), and stops at
  max_new_tokens or a stop id (committed and counted).
- The target decodes once per prompt with a KV cache, shared by every drafter and every k;
  `recompute=True` reruns it over the whole sequence, and tests check both agree exactly.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from tasks.evaluate.drafters import Drafter, TargetState

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class RequestResult:
    """One request decoded by one drafter."""

    drafter: str
    domain: str
    item_id: str
    prompt_tokens: int
    completion_tokens: int        # prefill token included, stop id included
    verify_rounds: int            # target forwards after the prefill (SGLang's spec_verify_ct)
    committed_drafts: int         # proposals accepted and committed
    accepted_by_position: list[int]  # [j]: rounds whose draft token j (0-based) was accepted and committed
    proposed_by_position: list[int]  # [j]: rounds that proposed a token j
    finish_reason: FinishReason
    output_ids: list[int] = field(repr=False)

    @property
    def acceptance_length(self) -> float | None:
        """completion_tokens / verify_rounds; None without a verify round (no speculation happened)."""
        return self.completion_tokens / self.verify_rounds if self.verify_rounds else None

    @property
    def tokens_per_verify_round(self) -> float | None:
        """(committed drafts + one bonus per round) / verify_rounds: the prefill's token left out."""
        return (self.committed_drafts + self.verify_rounds) / self.verify_rounds if self.verify_rounds else None


class _Target:
    """The target's forwards for one request: incremental (a KV cache), or recomputed.

    Both return logits of the fed tokens only and transformers' hidden-state tuple for them; the
    recomputing mode reruns the whole sequence and slices (the reference the cache is tested against).
    """

    def __init__(self, model: PreTrainedModel, recompute: bool) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = None if recompute else DynamicCache(config=model.config)
        # transformers 5.x names the cache argument `cache`, 4.x `past_key_values` (as tasks/model/target.py).
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def forward(self, seq: torch.Tensor, n_new: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Logits [n_new, V] and states [n_new, H] of the last `n_new` tokens of `seq` (the rest is cached)."""
        if self.cache is None:
            out = self.model(input_ids=seq[None], output_hidden_states=True, logits_to_keep=n_new)
            return out.logits[0], tuple(h[0, -n_new:] for h in out.hidden_states)
        if self.cache.get_seq_length() != seq.shape[0] - n_new:
            raise RuntimeError(f"KV cache holds {self.cache.get_seq_length()} positions, "
                               f"expected {seq.shape[0] - n_new}")
        out = self.model(input_ids=seq[None, -n_new:], output_hidden_states=True, use_cache=True,
                         **{self.cache_kwarg: self.cache})
        return out.logits[0], tuple(h[0] for h in out.hidden_states)


@dataclass(frozen=True)
class GreedyPath:
    """The target's plain greedy decoding of one prompt, with every state a drafter may read.

    `tokens` [n_prompt + n_new]: the prompt and the new tokens (a stop id, if reached, is the last);
    `hidden_states`: transformers' tuple (embeddings, each layer's output, post-norm final), each
    [n_prompt + n_new - 1, H]: position t holds the states after reading token t.
    """

    prompt_tokens: int
    tokens: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    finish_reason: FinishReason

    @property
    def new_ids(self) -> list[int]:
        return self.tokens[self.prompt_tokens:].tolist()

    def state(self, committed: int) -> TargetState:
        """What a drafter reads after `committed` new tokens: the newest has no state yet."""
        n = self.prompt_tokens + committed
        return TargetState(self.tokens[:n], tuple(h[:n - 1] for h in self.hidden_states))


@torch.inference_mode()
def greedy_path(target: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int,
                stop_ids: set[int] | frozenset[int] = frozenset(), *, recompute: bool = False) -> GreedyPath:
    """Decode greedily one token per forward (a KV cache, or `recompute` the whole sequence each
    step), keeping every position's states; stops at a stop id (kept) or after `max_new_tokens`."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompt_ids:
        raise ValueError("empty prompt")
    runner = _Target(target, recompute)
    tokens = torch.tensor(list(prompt_ids), dtype=torch.int64, device=target.device)
    logits, fed = runner.forward(tokens, tokens.shape[0])
    states = [fed]
    new = 0
    while True:
        token = int(logits[-1].argmax())
        tokens = torch.cat([tokens, tokens.new_tensor([token])])
        new += 1
        if token in stop_ids or new >= max_new_tokens:
            finish: FinishReason = "stop" if token in stop_ids else "length"
            break
        logits, fed = runner.forward(tokens, 1)
        states.append(fed)
    hidden = tuple(torch.cat(layer) for layer in zip(*states))
    return GreedyPath(len(prompt_ids), tokens, hidden, finish)


def target_greedy(target: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int,
                  stop_ids: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The target's own greedy decoding, one token per forward with a KV cache; the stop id is kept if reached."""
    return greedy_path(target, prompt_ids, max_new_tokens, stop_ids).new_ids


def speculative_generate(target: PreTrainedModel, prompt_ids: Sequence[int], drafter: Drafter, k: int,
                         max_new_tokens: int, stop_ids: set[int] | frozenset[int] = frozenset(), *,
                         domain: str = "", item_id: str = "", recompute: bool = False,
                         path: GreedyPath | None = None) -> RequestResult:
    """Greedy chain speculation of depth `k` with `drafter`, counted as SGLang counts (module docstring).

    Verification replays the target's plain greedy decoding (`path`, decoded here if not given):
    greedy verification accepts the longest prefix of the proposals that equals the target's greedy
    continuation and commits the target's next token after it, so the committed text *is* that
    decoding, token for token, in any precision. Checking k+1 proposals in one forward instead
    computes the same argmaxes only up to rounding, and in bf16 near-ties flip. One decoding serves
    every drafter (and every k) of a prompt; the drafter reads the states of committed positions.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    path = path or greedy_path(target, prompt_ids, max_new_tokens, stop_ids, recompute=recompute)
    new = path.new_ids
    if len(new) > max_new_tokens or list(path.tokens[:path.prompt_tokens].tolist()) != list(prompt_ids):
        raise ValueError("the greedy path belongs to another prompt or a longer max_new_tokens")
    accepted, proposed = [0] * k, [0] * k
    rounds = committed_drafts = 0
    committed = 1  # the prefill's token: no verify round
    while committed < len(new):
        props = [int(p) for p in drafter.propose(path.state(committed), k)[:k]]
        for j in range(len(props)):
            proposed[j] += 1
        a = 0
        while a < len(props) and committed + a < len(new) and props[a] == new[committed + a]:
            a += 1
        commit = min(a + 1, len(new) - committed)  # the accepted drafts and the target's next token
        # Drafts count as accepted only when committed, as SGLang's num_correct_drafts = appended - 1.
        n_drafts = min(a, commit)
        for j in range(n_drafts):
            accepted[j] += 1
        committed_drafts += n_drafts
        committed += commit
        rounds += 1
    return RequestResult(drafter.name, domain, item_id, len(prompt_ids), len(new), rounds, committed_drafts,
                         accepted, proposed, path.finish_reason, new)


class LossyDecoding(RuntimeError):
    """A drafter's output differs from the target's plain greedy output: the measurement is void."""


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a shorter one differs where it ends), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_lossless(results: Sequence[RequestResult], reference: Mapping[str, Sequence[int]]) -> int:
    """Raise LossyDecoding listing every request whose output is not the reference greedy output; else
    return how many outputs were checked."""
    problems = []
    for r in results:
        want = list(reference[r.item_id])
        pos = first_difference(r.output_ids, want)
        if pos is not None:
            got = r.output_ids[pos] if pos < len(r.output_ids) else "end"
            exp = want[pos] if pos < len(want) else "end"
            problems.append(f"{r.drafter} on {r.item_id}: differs from the target's greedy output at new token {pos} "
                            f"(speculative {got}, greedy {exp})")
    if problems:
        raise LossyDecoding(f"{len(problems)} of {len(results)} outputs are not the target's greedy output, so "
                            "their acceptance would be measured on another text:\n  " + "\n  ".join(problems[:20])
                            + ("\n  ..." if len(problems) > 20 else ""))
    return len(results)
