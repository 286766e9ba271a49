"""The online benchmark: tokens/s, TTFT, latency and acceptance length measured against running servers.

Owns the measurement of serving speed over HTTP: SGLang's native streaming `/generate`, llama.cpp's
streaming `/completion` (token ids in and out, draft counters in `timings`), vLLM's streaming
`/v1/completions` (token ids in and out, its per-request counters in `metrics.speculative_decoding`),
or the OpenAI streaming API for servers with none of these; and the acceptance probe run right
after a speculative launch. The numbers and the break-even arithmetic are in
serving/bench/results.py (re-exported here). Promises: acceptance comes only from the server's own
per-request counters (SGLang's `meta_info.spec_verify_ct`; llama.cpp's `timings.draft_n_accepted`;
vLLM's `num_accepted_draft_tokens`), reported both token-weighted (sum / sum) and as a per-request
mean under names that say which; a server declared speculative that reports no such counter is an
error naming the config, never an acceptance of 1.0; a "baseline" that reports one is an error too (it speculates, and every speedup against it would be
wrong); a failed request fails the benchmark rather than quietly leaving the slow tail out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from serving.bench.results import (BaselineSpeculates, BenchmarkError, BreakEven, BreakEvenReport, LevelResult,
                                   OnlineBenchResult, RequestMetrics, SpecMetricsMissing, break_even)
from serving.client import Endpoint, resolve_api_key

__all__ = ["AcceptanceTooLow", "BaselineSpeculates", "BenchmarkError", "BreakEven", "BreakEvenReport", "LevelResult",
           "OnlineBenchResult", "RequestMetrics", "ServerConfig", "SpecMetricsMissing", "break_even",
           "llamacpp_completion", "plot_throughput", "probe_acceptance", "run_online_benchmark", "vllm_completion"]

Message = Mapping[str, Any]
# A rendered chat prompt (text), its token ids, or a conversation (list of messages).
Prompt = str | Sequence[int] | Sequence[Message]
Api = Literal["sglang", "openai", "llamacpp", "vllm"]
SPECULATIVE_APIS = ("sglang", "llamacpp", "vllm")  # the APIs whose responses carry draft/verify counters
DRAFT_COUNTING_APIS = ("llamacpp", "vllm")  # per-request draft counters: a level that drafted nothing did not speculate

# Why acceptance is low, most telling first (docs/contracts.md, "Silent failures seen in the field").
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
    # "sglang": POST /generate; "llamacpp": POST /completion (llama-server); "vllm": /v1/completions with token
    # ids out and vLLM's per-request acceptance counters; "openai": /v1/chat/completions (or /v1/completions for text)
    api: Api = "sglang"
    model: str | None = None  # the OpenAI "model" field, where the server wants one
    num_draft_tokens: int | None = None  # --speculative-num-draft-tokens, for the acceptance-rate diagnosis
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # e.g. llama.cpp's repeat_penalty
    api_key_env: str | None = None  # environment variable holding the key (never logged)
    # llama.cpp reports draft counters only for requests that drafted: a speculative level where none
    # did is an error (the server did not speculate) unless False, for a server whose speculation was
    # verified otherwise (/slots) and whose drafter may propose nothing (n-gram lookup on text without repeats).
    expect_drafts: bool = True


# ---------------------------------------------------------------- requests


def _is_messages(prompt: Prompt) -> bool:
    return not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], Mapping)


def _request(cfg: ServerConfig, prompt: Prompt, max_new_tokens: int, temperature: float, ignore_eos: bool,
             render: Callable[[Sequence[Message]], str] | None) -> tuple[str, dict]:
    """The path and JSON body of one streaming request for this config's API."""
    if cfg.api in ("sglang", "llamacpp", "vllm") and _is_messages(prompt):
        if render is None:  # sending raw text instead would benchmark without the chat template
            path = {"sglang": "SGLang /generate", "llamacpp": "llama.cpp /completion",
                    "vllm": "vLLM /v1/completions"}[cfg.api]
            raise ValueError(f"config {cfg.label!r} uses {path}, which takes rendered text or token ids: pass "
                             "render= (the serving chat template) or rendered prompts")
        prompt = render(prompt)
    if cfg.api == "llamacpp":
        # Token ids are used verbatim (no BOS added); cache_prompt off: no config or level reads another's cache.
        body = {"prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt], "n_predict": max_new_tokens,
                "temperature": temperature, "stream": True, "return_tokens": True, "cache_prompt": False,
                "repeat_penalty": 1.0}  # llama.cpp applies 1.1 unless told: greedy would not be the target's
        if ignore_eos:
            body["ignore_eos"] = True
        return "/completion", {**body, **cfg.extra_body}
    if cfg.api == "sglang":
        source = {"text": prompt} if isinstance(prompt, str) else {"input_ids": [int(t) for t in prompt]}
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
        sampling.update(cfg.extra_body.get("sampling_params", {}))
        extra = {k: v for k, v in cfg.extra_body.items() if k != "sampling_params"}
        return "/generate", {**source, "sampling_params": sampling, "stream": True, **extra}
    body: dict[str, Any] = {"max_tokens": max_new_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.api == "vllm":
        # The ids streamed back (lossless check); the usage chunk carries vLLM's per-request acceptance counters
        # (`metrics.speculative_decoding`, from --per-request-spec-decode-metrics). Text is sent rendered.
        body.update(return_token_ids=True, model=cfg.model or "target",
                    prompt=prompt if isinstance(prompt, str) else [int(t) for t in prompt])
        if ignore_eos:
            body["ignore_eos"] = True
        return "/v1/completions", {**body, **cfg.extra_body}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM and SGLang accept it; others may ignore it
    if cfg.model:
        body["model"] = cfg.model
    if _is_messages(prompt):  # the server applies its chat template
        return "/v1/chat/completions", {**body, "messages": [dict(m) for m in prompt], **cfg.extra_body}
    # Already rendered (or token ids): the completions API, so the template is not applied twice.
    return "/v1/completions", {**body, "prompt": prompt if isinstance(prompt, str) else list(prompt), **cfg.extra_body}


def llamacpp_completion(events: Sequence[Mapping[str, Any]], cfg: ServerConfig, where: str = "") -> dict[str, Any]:
    """What one streamed llama-server `/completion` request generated, from its events (in order).

    Every partial event carries one generated id in `tokens` (`return_tokens`; llama.cpp sends no
    event for a token that ends inside a UTF-8 character, so `output_ids` can be shorter than
    `completion_tokens`); the final event (`stop: true`) carries `stop_type` and `timings`.
    Returns completion_tokens, spec_verify_ct, draft_n, draft_n_accepted, finish_reason, output_ids.

    - completion_tokens = `timings.predicted_n`: every generated token, the one sampled from the
      prefill's logits and an end-of-generation token included, as our offline evaluator counts.
    - spec_verify_ct = predicted_n - 1 - draft_n_accepted: the target forwards after the prefill,
      the offline evaluator's verify_rounds (so acceptance = completion_tokens / spec_verify_ct is
      the same quantity offline and online). Each forward after the prefill commits its accepted
      drafts plus one token of the target's own, so predicted_n - 1 = forwards + accepted. It counts
      forwards that had no draft (n-gram found no match; the last token before n_predict), which
      the server's log line "mean len = 1 + accepted / verification steps" leaves out: that is a
      different number. Where generation ends on an end-of-generation token accepted inside a draft,
      llama.cpp counts the accepted drafts after it too, so the count can be a little low there.
    - draft_n, draft_n_accepted: llama.cpp puts them in `timings` only when the request drafted;
      for a speculative config their absence is 0 (the level decides whether the server speculated
      at all), for a baseline their presence raises BaselineSpeculates.
    """
    final = None
    ids: list[int] = []
    for event in events:
        if event.get("stop"):
            final = event
        ids += [int(t) for t in event.get("tokens") or []]
    timings = (final or {}).get("timings") or {}
    if final is None or "predicted_n" not in timings:
        raise BenchmarkError(f"{where}: the stream ended before the request finished (no final event with timings)")
    drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
    if not cfg.speculative and drafted is not None:
        raise BaselineSpeculates(
            f"{where}: config {cfg.label!r} is declared the baseline (no speculation) but its response carries "
            f"timings.draft_n={drafted}: llama-server speculates, so no speedup against it means anything")
    predicted = int(timings["predicted_n"])
    verify = None
    if cfg.speculative:
        drafted, accepted = int(drafted or 0), int(accepted or 0)
        verify = max(predicted - 1 - accepted, 0)
    return {"completion_tokens": predicted, "spec_verify_ct": verify, "draft_n": drafted, "draft_n_accepted": accepted,
            "finish_reason": final.get("stop_type"), "output_ids": tuple(ids)}


def vllm_completion(events: Sequence[Mapping[str, Any]], cfg: ServerConfig, where: str = "") -> dict[str, Any]:
    """What one streamed vLLM `/v1/completions` request generated, from its events (in order).

    Each chunk's choice carries the new ids (`return_token_ids`); the final usage chunk carries
    `usage.completion_tokens` and, on a speculative server, vLLM's own per-request counters
    `metrics.speculative_decoding`: `num_spec_steps` (verify rounds that had drafts),
    `num_draft_tokens`, `num_accepted_draft_tokens` and `acceptance_histogram` (rounds by the number
    of drafts accepted). Returns completion_tokens, spec_verify_ct, draft_n, draft_n_accepted,
    finish_reason, output_ids, acceptance_histogram, spec_steps.

    spec_verify_ct = completion_tokens - 1 - accepted: the target forwards after the prefill, as for
    llama.cpp and the offline evaluator (each forward commits its accepted drafts plus one token of
    its own); it counts forwards that had no draft (n-gram found no match), which vLLM's own "mean
    acceptance length" (1 + accepted / num_spec_steps) leaves out.
    """
    ids: list[int] = []
    finish = usage = None
    metrics: Mapping[str, Any] | None = None
    for event in events:
        for choice in event.get("choices") or []:
            ids += [int(t) for t in choice.get("token_ids") or []]
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            usage = event["usage"]
            metrics = (event.get("metrics") or {}).get("speculative_decoding")
    if usage is None or finish is None:
        raise BenchmarkError(f"{where}: the stream ended before the request finished (no finish_reason and usage)")
    completion = int(usage["completion_tokens"])
    if not cfg.speculative:
        if metrics is not None:
            raise BaselineSpeculates(
                f"{where}: config {cfg.label!r} is declared the baseline (no speculation) but its response carries "
                f"metrics.speculative_decoding ({metrics}): vLLM speculates, so no speedup against it means anything")
        return {"completion_tokens": completion, "spec_verify_ct": None, "draft_n": None, "draft_n_accepted": None,
                "finish_reason": finish, "output_ids": tuple(ids), "acceptance_histogram": None, "spec_steps": None}
    if metrics is None:
        raise SpecMetricsMissing(
            f"{where}: config {cfg.label!r} is declared speculative but its response has no "
            "metrics.speculative_decoding: vLLM was started without --speculative-config or without "
            "--per-request-spec-decode-metrics; no acceptance length can be measured")
    accepted = int(metrics["num_accepted_draft_tokens"])
    return {"completion_tokens": completion, "spec_verify_ct": max(completion - 1 - accepted, 0),
            "draft_n": int(metrics["num_draft_tokens"]), "draft_n_accepted": accepted, "finish_reason": finish,
            "output_ids": tuple(ids), "acceptance_histogram": tuple(int(x) for x in metrics["acceptance_histogram"]),
            "spec_steps": int(metrics["num_spec_steps"])}


async def _measure(client: httpx.AsyncClient, cfg: ServerConfig, url: str, headers: dict, path: str, body: dict,
                   concurrency: int, index: int) -> RequestMetrics:
    """Send one streaming request and time it; tokens come from the server's own counts where it gives them."""
    where = f"config {cfg.label!r} ({url}{path}), prompt {index}"
    ttft = None
    chunks = 0
    usage_tokens = None
    finish: str | None = None
    meta: dict = {}
    events: list[dict] = []  # llama.cpp /completion and vLLM: kept for llamacpp_completion / vllm_completion
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
                elif path == "/completion":
                    events.append(event)
                    got = bool(event.get("tokens"))
                elif cfg.api == "vllm":
                    events.append(event)
                    got = any(c.get("token_ids") for c in event.get("choices") or [])
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

    if path == "/completion":
        done = llamacpp_completion(events, cfg, where)
        return RequestMetrics(cfg.label, concurrency, index, done["completion_tokens"], ttft, latency,
                              done["spec_verify_ct"], None, done["finish_reason"], "timings", done["draft_n"],
                              done["draft_n_accepted"], done["output_ids"])
    if cfg.api == "vllm":
        done = vllm_completion(events, cfg, where)
        return RequestMetrics(cfg.label, concurrency, index, done["completion_tokens"], ttft, latency,
                              done["spec_verify_ct"], None, done["finish_reason"], "usage", done["draft_n"],
                              done["draft_n_accepted"], done["output_ids"], done["acceptance_histogram"])
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
    if cfg.speculative and cfg.api in DRAFT_COUNTING_APIS:
        if cfg.expect_drafts and not level.draft_n:
            counter = "timings.draft_n" if cfg.api == "llamacpp" else "metrics.speculative_decoding.num_draft_tokens"
            raise SpecMetricsMissing(
                f"config {cfg.label!r} ({url}) at concurrency {concurrency} is declared speculative but no response "
                f"carries {counter} > 0: the server did not draft a single token (check its log: llama-server serves "
                "without speculation when it cannot set it up); no acceptance length can be measured")
    elif cfg.speculative and level.completion_tokens and not level.spec_verify_ct:
        raise SpecMetricsMissing(f"config {cfg.label!r} at concurrency {concurrency}: spec_verify_ct is 0 on every "
                                 "request: the server did not speculate")
    return level


async def run_online_benchmark(endpoint_url: str | None, prompts: Sequence[Prompt], configs: Sequence[ServerConfig],
                               concurrency_levels: Sequence[int] = (1,), max_new_tokens: int = 256, *,
                               render: Callable[[Sequence[Message]], str] | None = None, warmup: int = 1,
                               temperature: float = 0.0, ignore_eos: bool = False,
                               requests_per_level: int | None = None, timeout_s: float = 600.0) -> OnlineBenchResult:
    """Measure each config at each concurrency level on the same prompts, config after config.

    Prompts are rendered chat prompts (text), token ids, or message lists; SGLang /generate and
    llama.cpp /completion need text or ids (pass `render`, the serving chat template, for message
    lists; ids are what a lossless comparison wants), the OpenAI API takes
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
        if cfg.speculative and cfg.api not in SPECULATIVE_APIS:
            raise ValueError(f"config {cfg.label!r} is speculative but uses the OpenAI API, which carries no "
                             "spec_verify_ct: use api='sglang' (/generate), 'llamacpp' (llama-server /completion) "
                             "or 'vllm' (vLLM's per-request counters)")
        if not (cfg.url or endpoint_url):
            raise ValueError(f"config {cfg.label!r} has no url and no endpoint_url was given")
    n = requests_per_level or len(prompts)
    levels: list[LevelResult] = []
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    for cfg in configs:
        url = (cfg.url or endpoint_url or "").rstrip("/")
        headers = _headers(cfg, url)
        # Built before any request: a prompt the API cannot take fails the run, not its middle.
        requests = [(i % len(prompts), *_request(cfg, prompts[i % len(prompts)], max_new_tokens, temperature,
                                                 ignore_eos, render)) for i in range(n)]
        # llama-server sometimes closes a kept-alive connection right after a streamed response, and the
        # next request on it fails (RemoteProtocolError, 2 of 12 back-to-back requests here): a fresh
        # connection per request (well under a millisecond on loopback) instead.
        keepalive = 0 if cfg.api == "llamacpp" else max(concurrency_levels)
        limits = httpx.Limits(max_connections=max(concurrency_levels), max_keepalive_connections=keepalive)
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
    lines.append("Likely causes (docs/contracts.md, silent failures):")
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
