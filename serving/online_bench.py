"""The online benchmark: tokens/s, TTFT, latency and acceptance length measured against running servers.

Owns the measurement of serving speed over HTTP (SGLang's native streaming `/generate`, or the
OpenAI streaming API for servers without it, e.g. the llama.cpp baseline), the acceptance probe
run right after a speculative launch, and the break-even arithmetic. Promises: acceptance comes
only from the server's own per-request `meta_info` (`completion_tokens`, `spec_verify_ct`), is
reported both token-weighted (sum / sum) and as a per-request mean under names that say which;
a server declared speculative that does not report `spec_verify_ct` is an error naming the
config, never an acceptance of 1.0; a "baseline" that reports it is an error too (it speculates,
and every speedup against it would be wrong); a failed request fails the benchmark rather than
quietly leaving the slow tail out of the numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from serving.client import Endpoint, resolve_api_key

Message = Mapping[str, Any]
# A rendered chat prompt (text), its token ids, or a conversation (list of messages).
Prompt = str | Sequence[int] | Sequence[Message]
Api = Literal["sglang", "openai"]

# Why acceptance is low, most telling first (CONTRACTS.md, "Silent failures seen in the field").
LIKELY_CAUSES: tuple[str, ...] = (
    (
        "wrong algorithm flag: --speculative-algorithm EAGLE instead of EAGLE3 (no aux hidden states are "
        "captured, fc is skipped; acceptance length ~1.0 and acceptance rate ~1/num_draft_tokens, no error)"
    ),
    (
        "checkpoint keys layers.0.* instead of midlayer.*: SGLang skips the unknown keys and runs a random "
        "decoder layer, no error"
    ),
    (
        "config.json without eagle_config (or eagle_aux_hidden_state_layer_ids at the top level): SGLang "
        "falls back to default aux layers, no error"
    ),
    (
        "aux layer ids off by one between conventions (captured before layer j; +1 rule changed in SGLang "
        "PR #25454): acceptance quietly lower"
    ),
    (
        "d2t holding absolute target ids instead of offsets (target_id - draft_id), or missing: wrong "
        "tokens proposed"
    ),
    "fc input dim != 3 x target hidden size, or lm_head missing: garbage drafts",
    (
        "training chat template != serving template (system prompt injected, thinking tokens dropped), or "
        "benchmark prompts sent without the chat template"
    ),
)


class BenchmarkError(RuntimeError):
    """A request failed or a server answered something the benchmark cannot measure."""


class SpecMetricsMissing(BenchmarkError):
    """A config declared speculative returned no `spec_verify_ct`: the server did not speculate."""


class BaselineSpeculates(BenchmarkError):
    """A config declared as the baseline (no speculation) returned `spec_verify_ct`."""


class AcceptanceTooLow(BenchmarkError):
    """The acceptance probe measured less than its threshold; the message lists the likely causes."""

    def __init__(self, message: str, measured: float, threshold: float, result: LevelResult):
        super().__init__(message)
        self.measured = measured
        self.threshold = threshold
        self.result = result
        self.causes = LIKELY_CAUSES


@dataclass(frozen=True)
class ServerConfig:
    """One running server to measure: the baseline (speculative=False) or a speculative config."""

    label: str
    speculative: bool = False
    url: str | None = None  # base URL; None: the benchmark's endpoint_url
    api: Api = "sglang"  # "sglang": POST /generate; "openai": /v1/chat/completions (or /v1/completions for text)
    model: str | None = None  # the OpenAI "model" field, where the server wants one
    num_draft_tokens: int | None = None  # --speculative-num-draft-tokens, for the acceptance-rate diagnosis
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # e.g. llama.cpp's repeat_penalty
    api_key_env: str | None = None  # environment variable holding the key (never logged)


@dataclass(frozen=True)
class RequestMetrics:
    """One measured request, as the client saw it (times) and as the server reported it (tokens)."""

    config: str
    concurrency: int
    prompt_index: int
    completion_tokens: int
    ttft_s: float | None  # send -> first event carrying a token
    latency_s: float  # send -> end of the stream
    spec_verify_ct: int | None
    spec_accept_rate: float | None  # as the server reported it (None where it did not)
    finish_reason: str | None
    tokens_source: Literal["meta_info", "usage", "stream_chunks"]

    @property
    def accept_length(self) -> float | None:
        if not self.spec_verify_ct:
            return None
        return self.completion_tokens / self.spec_verify_ct

    def to_row(self) -> dict[str, Any]:
        return {"config": self.config, "concurrency": self.concurrency, "prompt_index": self.prompt_index,
                "completion_tokens": self.completion_tokens, "ttft_ms": _ms(self.ttft_s),
                "latency_ms": _ms(self.latency_s), "spec_verify_ct": self.spec_verify_ct,
                "accept_length": _round(self.accept_length), "finish_reason": self.finish_reason,
                "tokens_source": self.tokens_source}


@dataclass(frozen=True)
class LevelResult:
    """All requests of one config at one concurrency level, and what they add up to."""

    config: str
    speculative: bool
    concurrency: int
    wall_s: float  # first send -> last stream end
    requests: tuple[RequestMetrics, ...]

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.requests)

    @property
    def output_tok_s(self) -> float:
        """Aggregate output tokens per second of wall clock, all streams together."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def ttft_quantile(self, q: float) -> float | None:
        return _quantile([r.ttft_s for r in self.requests if r.ttft_s is not None], q)

    def latency_quantile(self, q: float) -> float | None:
        return _quantile([r.latency_s for r in self.requests], q)

    @property
    def latency_mean_s(self) -> float | None:
        return statistics.fmean(r.latency_s for r in self.requests) if self.requests else None

    @property
    def spec_verify_ct(self) -> int | None:
        if not self.speculative:
            return None
        return sum(r.spec_verify_ct or 0 for r in self.requests)

    @property
    def accept_length_token_weighted(self) -> float | None:
        """sum(completion_tokens) / sum(spec_verify_ct) over all requests: what the server's log reports."""
        verify = self.spec_verify_ct
        return self.completion_tokens / verify if verify else None

    @property
    def accept_length_request_mean(self) -> float | None:
        """The mean of each request's completion_tokens / spec_verify_ct: short requests weigh as much as long ones."""
        per_request = [r.accept_length for r in self.requests if r.accept_length is not None]
        return statistics.fmean(per_request) if per_request else None

    @property
    def spec_accept_rate_mean(self) -> float | None:
        rates = [r.spec_accept_rate for r in self.requests if r.spec_accept_rate is not None]
        return statistics.fmean(rates) if rates else None

    @property
    def time_per_verify_round_s(self) -> float | None:
        """One stream's wall time per verify round: sum(latency) / sum(spec_verify_ct), prefill included."""
        verify = self.spec_verify_ct
        return sum(r.latency_s for r in self.requests) / verify if verify else None

    @property
    def time_per_token_s(self) -> float | None:
        """One stream's wall time per output token: sum(latency) / sum(completion_tokens)."""
        tokens = self.completion_tokens
        return sum(r.latency_s for r in self.requests) / tokens if tokens else None

    def to_row(self) -> dict[str, Any]:
        return {"config": self.config, "speculative": self.speculative, "concurrency": self.concurrency,
                "requests": len(self.requests), "completion_tokens": self.completion_tokens,
                "wall_s": round(self.wall_s, 3), "output_tok_s": round(self.output_tok_s, 2),
                "ttft_p50_ms": _ms(self.ttft_quantile(0.5)), "ttft_p90_ms": _ms(self.ttft_quantile(0.9)),
                "latency_mean_ms": _ms(self.latency_mean_s), "latency_p50_ms": _ms(self.latency_quantile(0.5)),
                "latency_p90_ms": _ms(self.latency_quantile(0.9)), "spec_verify_ct": self.spec_verify_ct,
                "accept_len_token_weighted": _round(self.accept_length_token_weighted),
                "accept_len_request_mean": _round(self.accept_length_request_mean)}

    def to_rows(self) -> list[dict[str, Any]]:
        """One row per request."""
        return [r.to_row() for r in self.requests]


@dataclass(frozen=True)
class BreakEven:
    """Whether one speculative config beats the baseline at one concurrency, and what it would take."""

    config: str
    concurrency: int
    baseline_tok_s: float
    spec_tok_s: float
    baseline_time_per_token_s: float  # per stream: concurrency / baseline_tok_s
    time_per_verify_round_s: float  # per stream, measured on the speculative run
    measured_accept_length: float  # token-weighted
    needed_accept_length: float  # time per verify round / baseline time per token
    predicted_speedup: float  # measured / needed
    speedup: float  # spec_tok_s / baseline_tok_s, measured

    @property
    def beats_baseline(self) -> bool:
        return self.measured_accept_length > self.needed_accept_length

    def to_row(self) -> dict[str, Any]:
        return {"config": self.config, "concurrency": self.concurrency,
                "baseline_tok_s": round(self.baseline_tok_s, 2), "spec_tok_s": round(self.spec_tok_s, 2),
                "baseline_ms_per_token": _ms(self.baseline_time_per_token_s),
                "ms_per_verify_round": _ms(self.time_per_verify_round_s),
                "accept_len_measured_token_weighted": _round(self.measured_accept_length),
                "accept_len_needed": _round(self.needed_accept_length),
                "predicted_speedup": _round(self.predicted_speedup), "speedup": _round(self.speedup),
                "beats_baseline": self.beats_baseline}


@dataclass(frozen=True)
class BreakEvenReport:
    items: tuple[BreakEven, ...]

    def to_rows(self) -> list[dict[str, Any]]:
        return [b.to_row() for b in self.items]


@dataclass(frozen=True)
class OnlineBenchResult:
    """Every (config, concurrency) level of one or more benchmark runs."""

    levels: tuple[LevelResult, ...]
    max_new_tokens: int

    @classmethod
    def combine(cls, results: Iterable[OnlineBenchResult]) -> OnlineBenchResult:
        """Runs of one config each (a production node serves one config at a time) as one result."""
        results = list(results)
        if len({r.max_new_tokens for r in results}) > 1:
            raise ValueError("results measured with different max_new_tokens do not compare")
        return cls(tuple(lv for r in results for lv in r.levels), results[0].max_new_tokens if results else 0)

    @property
    def configs(self) -> list[str]:
        return list(dict.fromkeys(lv.config for lv in self.levels))

    def level(self, config: str, concurrency: int) -> LevelResult:
        for lv in self.levels:
            if lv.config == config and lv.concurrency == concurrency:
                return lv
        raise KeyError(f"no level for config {config!r} at concurrency {concurrency}")

    def baseline_label(self, label: str | None = None) -> str | None:
        """The baseline config: `label` if given, else the only non-speculative config (None if none or several)."""
        if label is not None:
            return label
        baselines = list(dict.fromkeys(lv.config for lv in self.levels if not lv.speculative))
        return baselines[0] if len(baselines) == 1 else None

    def to_rows(self, baseline: str | None = None) -> list[dict[str, Any]]:
        """One row per level, with the throughput ratio against the baseline at the same concurrency."""
        base = self.baseline_label(baseline)
        base_tok_s = {lv.concurrency: lv.output_tok_s for lv in self.levels if lv.config == base}
        rows = []
        for lv in self.levels:
            row = lv.to_row()
            ref = base_tok_s.get(lv.concurrency)
            row["speedup_vs_baseline"] = round(lv.output_tok_s / ref, 3) if ref else None
            rows.append(row)
        return rows

    def break_even(self, baseline: str | None = None) -> BreakEvenReport:
        base = self.baseline_label(baseline)
        if base is None:
            raise ValueError("break-even needs one baseline: name it (several or no non-speculative configs)")
        base_tok_s = {lv.concurrency: lv.output_tok_s for lv in self.levels if lv.config == base}
        spec = [lv for lv in self.levels if lv.speculative and lv.concurrency in base_tok_s]
        return break_even(base_tok_s, spec)


def break_even(baseline_tok_s: float | Mapping[int, float], spec_levels: Iterable[LevelResult]) -> BreakEvenReport:
    """The acceptance length each speculative level needs to beat the baseline, from its measured step cost.

    `baseline_tok_s` is the baseline's aggregate tokens/s at the same concurrency (one number for all
    levels, or one per concurrency). With c streams at once, one baseline stream spends
    c / baseline_tok_s per token; one speculative stream spends latency / spec_verify_ct per verify
    round and gets `acceptance length` tokens from it. So the needed acceptance length is
    (time per verify round) / (baseline time per token), and measured / needed is the predicted
    speedup; the measured speedup is the ratio of aggregate tokens/s.
    """
    items = []
    for lv in spec_levels:
        ref = baseline_tok_s if isinstance(baseline_tok_s, (int, float)) else baseline_tok_s.get(lv.concurrency)
        if not ref or ref <= 0:
            raise ValueError(f"no baseline tokens/s for concurrency {lv.concurrency} (config {lv.config!r})")
        round_s, measured = lv.time_per_verify_round_s, lv.accept_length_token_weighted
        if round_s is None or measured is None:
            raise SpecMetricsMissing(f"config {lv.config!r} at concurrency {lv.concurrency} has no spec_verify_ct: "
                                     "break-even needs a speculative run")
        per_token = lv.concurrency / ref
        needed = round_s / per_token
        items.append(BreakEven(config=lv.config, concurrency=lv.concurrency, baseline_tok_s=float(ref),
                               spec_tok_s=lv.output_tok_s, baseline_time_per_token_s=per_token,
                               time_per_verify_round_s=round_s, measured_accept_length=measured,
                               needed_accept_length=needed, predicted_speedup=measured / needed,
                               speedup=lv.output_tok_s / ref))
    return BreakEvenReport(tuple(items))


# ---------------------------------------------------------------- requests


def _is_messages(prompt: Prompt) -> bool:
    return not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], Mapping)


def _request(cfg: ServerConfig, prompt: Prompt, max_new_tokens: int, temperature: float, ignore_eos: bool,
             render: Callable[[Sequence[Message]], str] | None) -> tuple[str, dict]:
    """The path and JSON body of one streaming request for this config's API."""
    if cfg.api == "sglang":
        if _is_messages(prompt):
            if render is None:  # sending raw text instead would benchmark without the chat template
                raise ValueError(f"config {cfg.label!r} uses SGLang /generate, which takes rendered text: pass "
                                 "render= (the serving chat template) or rendered prompts")
            prompt = render(prompt)
        source = {"text": prompt} if isinstance(prompt, str) else {"input_ids": [int(t) for t in prompt]}
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
        sampling.update(cfg.extra_body.get("sampling_params", {}))
        extra = {k: v for k, v in cfg.extra_body.items() if k != "sampling_params"}
        return "/generate", {**source, "sampling_params": sampling, "stream": True, **extra}
    body: dict[str, Any] = {"max_tokens": max_new_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM and SGLang accept it; others may ignore it
    if cfg.model:
        body["model"] = cfg.model
    if _is_messages(prompt):  # the server applies its chat template
        return "/v1/chat/completions", {**body, "messages": [dict(m) for m in prompt], **cfg.extra_body}
    # Already rendered (or token ids): the completions API, so the template is not applied twice.
    return "/v1/completions", {**body, "prompt": prompt if isinstance(prompt, str) else list(prompt), **cfg.extra_body}


async def _measure(client: httpx.AsyncClient, cfg: ServerConfig, url: str, headers: dict, path: str, body: dict,
                   concurrency: int, index: int) -> RequestMetrics:
    """Send one streaming request and time it; tokens come from the server's own counts where it gives them."""
    where = f"config {cfg.label!r} ({url}{path}), prompt {index}"
    ttft = None
    chunks = 0
    usage_tokens = None
    finish: str | None = None
    meta: dict = {}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                detail = (await r.aread())[:300].decode(errors="replace")
                raise BenchmarkError(f"{where}: HTTP {r.status_code}: {detail}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    raise BenchmarkError(f"{where}: malformed stream event {data[:200]!r}") from None
                if isinstance(event, dict) and event.get("error"):
                    raise BenchmarkError(f"{where}: the server reported an error: {str(event['error'])[:300]}")
                if path == "/generate":
                    meta = event.get("meta_info") or {}
                    got = bool(event.get("text") or event.get("output_ids") or meta.get("completion_tokens"))
                else:
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                    got = False
                    for choice in event.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") or choice.get("text")
                        if text:
                            chunks += 1
                            got = True
                        finish = choice.get("finish_reason") or finish
                if got and ttft is None:
                    ttft = time.perf_counter() - start
    except httpx.HTTPError as e:
        raise BenchmarkError(f"{where}: {type(e).__name__}: {e}") from None
    latency = time.perf_counter() - start

    if path != "/generate":
        if finish is None:  # a cut stream would count as a fast short answer
            raise BenchmarkError(f"{where}: the stream ended without a finish_reason")
        tokens = usage_tokens if usage_tokens is not None else chunks
        source = "usage" if usage_tokens is not None else "stream_chunks"
        return RequestMetrics(cfg.label, concurrency, index, int(tokens), ttft, latency, None, None, finish, source)

    reason = meta.get("finish_reason")
    if reason is None or "completion_tokens" not in meta:
        raise BenchmarkError(f"{where}: the stream ended before the request finished (last meta_info: {meta})")
    verify = meta.get("spec_verify_ct")
    if cfg.speculative and verify is None:
        raise SpecMetricsMissing(
            f"{where}: config {cfg.label!r} is declared speculative but its response has no "
            "meta_info.spec_verify_ct: the server did not speculate (SGLang reports it only when "
            "--speculative-algorithm is set); no acceptance length can be measured")
    if not cfg.speculative and verify is not None:
        raise BaselineSpeculates(
            f"{where}: config {cfg.label!r} is declared the baseline (no speculation) but its response "
            f"carries meta_info.spec_verify_ct={verify}: it speculates, so no speedup against it means anything")
    rate = meta.get("spec_accept_rate")
    return RequestMetrics(cfg.label, concurrency, index, int(meta["completion_tokens"]), ttft, latency,
                          None if verify is None else int(verify), None if rate is None else float(rate),
                          reason.get("type") if isinstance(reason, dict) else str(reason), "meta_info")


def _headers(cfg: ServerConfig, url: str) -> dict:
    key = resolve_api_key(Endpoint(url, api_key_env=cfg.api_key_env)) if cfg.api_key_env else None
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _run_level(client: httpx.AsyncClient, cfg: ServerConfig, url: str, headers: dict,
                     requests: Sequence[tuple[int, str, dict]], concurrency: int) -> LevelResult:
    """`concurrency` closed-loop streams working through `requests`; wall clock from first send to last end."""
    pending = iter(requests)
    done: list[RequestMetrics] = []

    async def stream() -> None:
        for index, path, body in pending:  # one shared iterator: each request is taken once
            done.append(await _measure(client, cfg, url, headers, path, body, concurrency, index))

    start = time.perf_counter()
    tasks = [asyncio.create_task(stream()) for _ in range(min(concurrency, len(requests)))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:  # a failed request stops the level: its numbers would be biased
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    wall = time.perf_counter() - start
    level = LevelResult(cfg.label, cfg.speculative, concurrency, wall, tuple(sorted(done, key=lambda r: r.prompt_index)))
    if cfg.speculative and level.completion_tokens and not level.spec_verify_ct:
        raise SpecMetricsMissing(f"config {cfg.label!r} at concurrency {concurrency}: spec_verify_ct is 0 on every "
                                 "request: the server did not speculate")
    return level


async def run_online_benchmark(endpoint_url: str | None, prompts: Sequence[Prompt], configs: Sequence[ServerConfig],
                               concurrency_levels: Sequence[int] = (1,), max_new_tokens: int = 256, *,
                               render: Callable[[Sequence[Message]], str] | None = None, warmup: int = 1,
                               temperature: float = 0.0, ignore_eos: bool = False,
                               requests_per_level: int | None = None, timeout_s: float = 600.0) -> OnlineBenchResult:
    """Measure each config at each concurrency level on the same prompts, config after config.

    Prompts are rendered chat prompts (text), token ids, or message lists; SGLang /generate needs
    text or ids (pass `render`, the serving chat template, for message lists), the OpenAI API takes
    message lists on /v1/chat/completions and text on /v1/completions. Compare configs only on the
    same template. Every level sends `requests_per_level` requests (default: each prompt once,
    cycling through the prompts when more), greedy by default. `warmup` unmeasured requests go to each
    config first (CUDA graph capture, caches). A config with no `url` uses `endpoint_url`.
    """
    if not prompts:
        raise ValueError("the online benchmark needs at least one prompt")
    if any(c < 1 for c in concurrency_levels) or not concurrency_levels:
        raise ValueError(f"concurrency levels must be >= 1, got {list(concurrency_levels)}")
    if len({c.label for c in configs}) != len(configs):
        raise ValueError("config labels must be unique")
    for cfg in configs:
        if cfg.speculative and cfg.api != "sglang":
            raise ValueError(f"config {cfg.label!r} is speculative but uses the OpenAI API, which carries no "
                             "spec_verify_ct: use api='sglang' (/generate)")
        if not (cfg.url or endpoint_url):
            raise ValueError(f"config {cfg.label!r} has no url and no endpoint_url was given")
    n = requests_per_level or len(prompts)
    levels: list[LevelResult] = []
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=max(concurrency_levels), max_keepalive_connections=max(concurrency_levels))
    for cfg in configs:
        url = (cfg.url or endpoint_url or "").rstrip("/")
        headers = _headers(cfg, url)
        # Built before any request: a prompt the API cannot take fails the run, not its middle.
        requests = [(i % len(prompts), *_request(cfg, prompts[i % len(prompts)], max_new_tokens, temperature,
                                                 ignore_eos, render)) for i in range(n)]
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            for index, path, body in requests[:warmup]:
                await _measure(client, cfg, url, headers, path, body, 1, index)
            for c in concurrency_levels:
                levels.append(await _run_level(client, cfg, url, headers, requests, c))
    return OnlineBenchResult(tuple(levels), max_new_tokens)


async def probe_acceptance(url: str | ServerConfig, prompts: Sequence[Prompt], threshold: float = 1.3, *,
                           n_prompts: int = 20, max_new_tokens: int = 64, concurrency: int = 4,
                           render: Callable[[Sequence[Message]], str] | None = None,
                           num_draft_tokens: int | None = None, timeout_s: float = 600.0) -> LevelResult:
    """Right after a speculative launch: `n_prompts` prompts, and raise `AcceptanceTooLow` below `threshold`.

    Returns the probe's level (token-weighted acceptance in `accept_length_token_weighted`).
    """
    cfg = url if isinstance(url, ServerConfig) else ServerConfig("speculative", speculative=True, url=url,
                                                                 num_draft_tokens=num_draft_tokens)
    if not cfg.speculative:  # the probe is for speculative servers: a missing spec_verify_ct must raise
        cfg = dataclasses.replace(cfg, speculative=True)
    sample = list(prompts)[:n_prompts]
    result = await run_online_benchmark(cfg.url, sample, [cfg], [concurrency], max_new_tokens, render=render,
                                        warmup=0, timeout_s=timeout_s)
    level = result.levels[0]
    measured = level.accept_length_token_weighted or 0.0
    if measured >= threshold:
        return level
    k = cfg.num_draft_tokens
    lines = [(f"speculative server {cfg.label!r} at {cfg.url}: token-weighted acceptance length {measured:.2f} "
              f"(sum completion_tokens / sum spec_verify_ct over {len(level.requests)} requests; per-request mean "
              f"{(level.accept_length_request_mean or 0.0):.2f}) is below the threshold {threshold:.2f}.")]
    rate = level.spec_accept_rate_mean
    if rate is not None:
        lines.append(f"The server's mean spec_accept_rate: {rate:.2f}.")
    if measured < 1.1:
        ratio = f" = {measured / k:.2f} with {k} draft tokens, i.e. ~1/num_draft_tokens" if k else ""
        lines.append(f"An acceptance length of ~1.0 (acceptance length / num_draft_tokens{ratio}) means almost no "
                     "draft token is accepted: check --speculative-algorithm EAGLE3 (not EAGLE) first.")
    lines.append("Likely causes (CONTRACTS.md, silent failures):")
    lines += [f"  - {cause}" for cause in LIKELY_CAUSES]
    raise AcceptanceTooLow("\n".join(lines), measured, threshold, level)


# ---------------------------------------------------------------- plot


def plot_throughput(result: OnlineBenchResult, path: str | Path, *, baseline: str | None = None,
                    title: str = "Output tokens/s by concurrency") -> Path:
    """A PNG of aggregate tokens/s per config against concurrency, the baseline dashed, speedups annotated."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    base = result.baseline_label(baseline)
    base_tok_s = {lv.concurrency: lv.output_tok_s for lv in result.levels if lv.config == base}
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)  # no pyplot: no global backend, safe in workers and threads
    ax = fig.add_subplot()
    for config in result.configs:
        levels = sorted((lv for lv in result.levels if lv.config == config), key=lambda lv: lv.concurrency)
        xs, ys = [lv.concurrency for lv in levels], [lv.output_tok_s for lv in levels]
        is_base = config == base
        ax.plot(xs, ys, "k--" if is_base else "-", marker="o", label=f"{config} (baseline)" if is_base else config)
        if not is_base:
            for x, y in zip(xs, ys):
                if base_tok_s.get(x):
                    ax.annotate(f"{y / base_tok_s[x]:.2f}x", (x, y), textcoords="offset points", xytext=(4, 6),
                                fontsize=8)
    concurrencies = sorted({lv.concurrency for lv in result.levels})
    if len(concurrencies) > 1 and concurrencies[-1] / concurrencies[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s (all streams)")
    ax.set_title(f"{title} (max_new_tokens={result.max_new_tokens})")
    ax.set_ylim(bottom=0)
    ax.margins(x=0.1, y=0.12)  # room for the speedup labels at the edges
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return path


# ---------------------------------------------------------------- helpers


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)
