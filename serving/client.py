"""An async client for a pool of inference servers (OpenAI-compatible chat, SGLang /generate, llama.cpp).

Owns HTTP: balancing by outstanding requests, a concurrency limit per endpoint, timeouts,
retries with exponential backoff and full jitter (429 honouring Retry-After, 5xx, connection
resets, timeouts, malformed or truncated bodies), and ejecting an endpoint that keeps failing
until a health probe brings it back. Promises: a request either returns a `ChatResult` or raises
`RequestFailed` with the last reason and the attempt count (`unreachable` when no server answered
its last attempt); while every endpoint is out, requests wait for a probe to bring one back, and
once that has lasted `outage_window_s` each of them raises one `EndpointsDown` that names the
endpoints and their last errors (an outage, never a per-request failure); API keys are read from the
environment (or a Prefect Secret block) at call time and never appear in a message, a log line,
`repr` or a result. On llama.cpp endpoints (`kind="llamacpp"`) `chat` is token-exact: the server
renders the messages with its own template, the prompt is sent as token ids, and the result carries
the prompt ids sent and the ids the server sampled, so training sees exactly what the target did.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Literal

import httpx


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:8000 (the client appends /v1/chat/completions)
    max_concurrency: int = 8
    api_key_env: str | None = None  # name of the environment variable holding the key
    api_key_secret_block: str | None = None  # or the name of a Prefect Secret block
    # "llamacpp": llama-server, asked token-exact (/apply-template, /tokenize, /completion with ids)
    kind: Literal["openai", "sglang", "llamacpp"] = "openai"

    def __repr__(self) -> str:  # no key material, ever
        return f"Endpoint({self.url}, max_concurrency={self.max_concurrency}, kind={self.kind})"


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    eject_after_failures: int = 5  # consecutive failures that take an endpoint out
    probe_interval_s: float = 10.0  # how often an ejected endpoint is probed
    # Every endpoint out for this long is an outage: stop and say so (a TP-8 server can restart in
    # a few minutes, so a shorter wait would stop a multi-day run for a routine restart).
    outage_window_s: float = 300.0


@dataclass
class ChatResult:
    content: str
    reasoning_content: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    served_model: str | None
    endpoint: str
    latency_s: float
    attempts: int
    server_build: str | None = None  # the engine's build as it reports it (llama.cpp: "b1-0c1e570")


class RequestFailed(RuntimeError):
    """One request's attempts ran out. `unreachable`: its last attempt reached no server at all
    (refused, reset, timed out), so the request itself may be fine and is worth asking again later."""

    def __init__(self, reason: str, attempts: int, unreachable: bool = False):
        super().__init__(f"{reason} (after {attempts} attempt{'s' if attempts != 1 else ''})")
        self.reason = reason
        self.attempts = attempts
        self.unreachable = unreachable


class EndpointsDown(RuntimeError):
    """Every endpoint has been out for longer than the outage window: stop, do not fail requests."""


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after_s: float | None = None, transport: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.transport = transport  # the server did not answer at all (refused, reset, timeout)


class _Fatal(Exception):
    """A request the server refused for a reason retrying cannot fix (400, 401, 404 ...)."""


def _retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def resolve_api_key(ep: Endpoint) -> str | None:
    if ep.api_key_env:
        key = os.environ.get(ep.api_key_env)
        if not key:
            raise RequestFailed(f"endpoint {ep.url}: environment variable {ep.api_key_env} is not set", 0)
        return key
    if ep.api_key_secret_block:
        from prefect.blocks.system import Secret

        return Secret.load(ep.api_key_secret_block).get()
    return None


class _EndpointState:
    def __init__(self, ep: Endpoint):
        self.ep = ep
        self.outstanding = 0
        self.free_slots = list(range(ep.max_concurrency))
        self.clients: list[httpx.AsyncClient] = []
        self.failing_requests: set[int] = set()  # distinct requests failed since the last success
        self.ejected = False
        self.ejected_at = 0.0  # time.monotonic() of the latest ejection
        self.last_error: str | None = None
        self.probe_task: asyncio.Task | None = None
        self.requests = 0
        self.failures = 0
        self.build: str | None = None  # what the server says it is, recorded with every result


@dataclass
class PoolStats:
    requests: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    ejections: int = 0


def parse_chat_response(body: bytes, endpoint: str) -> dict:
    """The fields of an OpenAI chat completion; malformed or truncated JSON is retryable."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _Retryable(f"malformed JSON from {endpoint}: {e.msg if hasattr(e, 'msg') else e}") from None
    try:
        choice = data["choices"][0]
        message = choice.get("message") or {}
        usage = data.get("usage") or {}
        return {
            "content": message.get("content") or "",
            "reasoning_content": message.get("reasoning_content"),
            "finish_reason": choice.get("finish_reason"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "prompt_token_ids": data.get("prompt_token_ids") or choice.get("prompt_token_ids"),
            "completion_token_ids": choice.get("token_ids") or choice.get("output_ids"),
            "served_model": data.get("model"),
        }
    except (KeyError, IndexError, TypeError, AttributeError):
        raise _Retryable(f"unexpected response shape from {endpoint}: {str(data)[:200]}") from None


def parse_sglang_generate(body: bytes, endpoint: str) -> dict:
    """SGLang native /generate: text, output ids and meta_info."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _Retryable(f"malformed JSON from {endpoint}") from None
    if isinstance(data, list):
        data = data[0]
    meta = data.get("meta_info") or {}
    finish = meta.get("finish_reason")
    return {
        "content": data.get("text") or "",
        "reasoning_content": None,
        "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
        "prompt_tokens": meta.get("prompt_tokens"),
        "completion_tokens": meta.get("completion_tokens"),
        "prompt_token_ids": None,
        "completion_token_ids": data.get("output_ids"),
        "served_model": None,
    }


# llama.cpp's reasons for stopping, in OpenAI's words.
_LLAMACPP_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}
# The OpenAI sampling fields a chat request carries, as llama.cpp's /completion names them.
_LLAMACPP_PARAMS = {"max_tokens": "n_predict", "temperature": "temperature", "top_p": "top_p", "seed": "seed",
                    "stop": "stop", "repeat_penalty": "repeat_penalty"}


def _json_body(body: bytes, endpoint: str) -> dict:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _Retryable(f"malformed JSON from {endpoint}") from None
    if not isinstance(data, dict):
        raise _Retryable(f"unexpected response shape from {endpoint}: {str(data)[:200]}")
    return data


def parse_llamacpp_completion(body: bytes, endpoint: str) -> dict:
    """llama.cpp's /completion with `return_tokens`: text, the sampled ids, why it stopped, its timings."""
    data = _json_body(body, endpoint)
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or "content" not in data:
        raise _Retryable(f"unexpected response shape from {endpoint} (no `tokens`/`content`): {str(data)[:200]}")
    timings = data.get("timings") or {}
    return {
        "content": data["content"],
        "reasoning_content": None,
        "finish_reason": _LLAMACPP_FINISH.get(data.get("stop_type"), data.get("stop_type")),
        "prompt_tokens": timings.get("prompt_n", 0) + timings.get("cache_n", 0) if timings else None,
        "completion_tokens": data.get("tokens_predicted", len(tokens)),
        "prompt_token_ids": None,  # the caller knows what it sent
        "completion_token_ids": [int(t) for t in tokens],
        "served_model": data.get("model"),
    }


# httpx's pool scans its open connections on every request, so one client with hundreds of
# connections costs milliseconds of CPU per request; shards of a few connections each do not
# (benchmarks/regenerate_client.py measured 4.6 -> 1.2 ms at 64 in flight).
_CONNECTIONS_PER_CLIENT = 8


def _parse_template(body: bytes, endpoint: str) -> dict:
    prompt = _json_body(body, endpoint).get("prompt")
    if not isinstance(prompt, str):
        raise _Retryable(f"no rendered `prompt` from {endpoint}/apply-template")
    return _fields(content=prompt)


def _parse_tokenize(body: bytes, endpoint: str) -> dict:
    tokens = _json_body(body, endpoint).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise _Retryable(f"no `tokens` list from {endpoint}/tokenize")
    return _fields(completion_token_ids=tokens)


def _fields(**values) -> dict:
    blank = {"content": "", "reasoning_content": None, "finish_reason": None, "prompt_tokens": None,
             "completion_tokens": None, "prompt_token_ids": None, "completion_token_ids": None, "served_model": None}
    return {**blank, **values}


_PARSERS = {"/generate": parse_sglang_generate, "/completion": parse_llamacpp_completion,
            "/apply-template": _parse_template, "/tokenize": _parse_tokenize}


class ServerPool:
    """Requests spread over endpoints; use as `async with ServerPool(...) as pool`."""

    def __init__(self, endpoints: list[Endpoint], policy: RetryPolicy | None = None, *, seed: int | None = None):
        if not endpoints:
            raise ValueError("a server pool needs at least one endpoint")
        self.policy = policy or RetryPolicy()
        self._states = [_EndpointState(ep) for ep in endpoints]
        self._rng = random.Random(seed)
        self._keys: dict[str, str | None] = {}
        self._request_ids = itertools.count()
        self.stats = PoolStats()
        # Wakes requests waiting out an ejection. An Event, not a Condition: a Condition's waiter must
        # re-acquire its lock when cancelled, and cancelling many at once (an outage stopping the
        # stage) left asyncio.run waiting forever on Python 3.11.
        self._changed = asyncio.Event()
        self._capacity = asyncio.Semaphore(sum(s.ep.max_concurrency for s in self._states))

    async def __aenter__(self) -> "ServerPool":
        # Keys first: a missing one fails before any connection pool exists. A worker thread, since
        # Prefect's Secret.load is sync-or-async depending on whether a loop runs in the caller.
        self._keys = {s.ep.url: await asyncio.to_thread(resolve_api_key, s.ep) for s in self._states}
        timeout = httpx.Timeout(self.policy.read_timeout_s, connect=self.policy.connect_timeout_s)
        limits = httpx.Limits(max_connections=_CONNECTIONS_PER_CLIENT, max_keepalive_connections=_CONNECTIONS_PER_CLIENT)
        for s in self._states:
            shards = -(-s.ep.max_concurrency // _CONNECTIONS_PER_CLIENT)
            s.clients = [httpx.AsyncClient(limits=limits, timeout=timeout) for _ in range(shards)]
        await asyncio.gather(*(self._read_build(s) for s in self._states))
        return self

    async def _read_build(self, state: _EndpointState) -> None:
        """The engine's version, if it says (llama.cpp /props, vLLM /version, SGLang /get_server_info).

        Best effort and brief: an endpoint that is down now is the retry logic's business."""
        for path, key in (("/props", "build_info"), ("/version", "version"), ("/get_server_info", "version")):
            try:
                r = await state.clients[0].get(state.ep.url.rstrip("/") + path, headers=self._headers(state), timeout=2.0)
            except httpx.HTTPError:
                return
            if r.status_code == 200:
                try:
                    value = r.json().get(key)
                except (ValueError, AttributeError):
                    continue
                if isinstance(value, str) and value:
                    state.build = f"llama.cpp {value}" if key == "build_info" else value
                    return

    async def __aexit__(self, *exc) -> None:
        for s in self._states:
            if s.probe_task is not None:
                s.probe_task.cancel()
            for c in s.clients:
                await c.aclose()

    # -------------------------------------------------------------- endpoint choice

    async def _acquire(self) -> tuple[_EndpointState, int]:
        """The live endpoint with the fewest outstanding requests (ties at random), and a slot on it.

        Callers queue on a pool-wide semaphore first (one waiter woken per freed slot, in order),
        so thousands of queued requests cost nothing while they wait. While every endpoint is
        ejected it waits for a probe; past `outage_window_s` of that it raises EndpointsDown.
        """
        await self._capacity.acquire()
        try:
            while True:
                live = [s for s in self._states if not s.ejected and s.outstanding < s.ep.max_concurrency]
                if live:
                    low = min(s.outstanding for s in live)
                    state = self._rng.choice([s for s in live if s.outstanding == low])
                    state.outstanding += 1  # no await since the check: the slot is ours
                    return state, state.free_slots.pop()
                # Only while endpoints are ejected can a capacity holder find no free slot.
                if all(s.ejected for s in self._states):
                    all_out_since = max(s.ejected_at for s in self._states)
                    if time.monotonic() - all_out_since > self.policy.outage_window_s:
                        raise EndpointsDown(self._outage_message(time.monotonic() - all_out_since))
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
        except BaseException:
            self._capacity.release()
            raise

    def _notify(self) -> None:
        self._changed.set()  # wakes every current waiter ...
        self._changed.clear()  # ... and later ones wait for the next change

    def _outage_message(self, seconds: float) -> str:
        down = "; ".join(f"{s.ep.url} (last error: {s.last_error or 'none recorded'})" for s in self._states)
        return (f"every endpoint has been unreachable for {seconds:.0f} s (the outage window, "
                f"retry.outage_window_s = {self.policy.outage_window_s:g} s): {down}. No request was recorded as "
                "failed because of it; bring a server back and run the same command to continue")

    async def _release(self, state: _EndpointState, slot: int, failure_token: int | None,
                       error: str | None = None) -> None:
        """Give the slot back; `failure_token` is None on success, else what the failure counts as."""
        state.outstanding -= 1
        state.free_slots.append(slot)
        self._capacity.release()
        state.requests += 1
        self.stats.requests[state.ep.url] = state.requests
        if failure_token is None:
            state.failing_requests.clear()
        else:
            state.failures += 1
            state.last_error = error or state.last_error
            self.stats.failures[state.ep.url] = state.failures
            state.failing_requests.add(failure_token)
            if len(state.failing_requests) >= self.policy.eject_after_failures and not state.ejected:
                state.ejected = True
                state.ejected_at = time.monotonic()
                self.stats.ejections += 1
                state.probe_task = asyncio.create_task(self._probe_until_back(state))
        if any(s.ejected for s in self._states):
            self._notify()  # wake holders waiting out an ejection

    async def _probe_until_back(self, state: _EndpointState) -> None:
        """An ejected endpoint gets no real request until GET /v1/models answers 200 again."""
        while True:
            await asyncio.sleep(self.policy.probe_interval_s)
            try:
                r = await state.clients[0].get(state.ep.url.rstrip("/") + "/v1/models", headers=self._headers(state), timeout=5.0)
                if r.status_code == 200:
                    break
                state.last_error = f"HTTP {r.status_code} from the probe GET /v1/models"
            except httpx.TransportError as e:
                state.last_error = f"connection error ({type(e).__name__}) from the probe GET /v1/models"
            except httpx.HTTPError as e:
                state.last_error = f"{type(e).__name__} from the probe GET /v1/models"
        state.ejected = False
        state.failing_requests.clear()
        state.probe_task = None
        self._notify()

    def _headers(self, state: _EndpointState) -> dict:
        key = self._keys.get(state.ep.url)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _redact(self, text: str) -> str:
        for key in self._keys.values():
            if key:
                text = text.replace(key, "[redacted]")
        return text

    # -------------------------------------------------------------- requests

    async def _send_once(self, state: _EndpointState, slot: int, payload: dict, path: str) -> dict:
        url = state.ep.url.rstrip("/") + path
        client = state.clients[slot // _CONNECTIONS_PER_CLIENT]
        try:
            r = await client.post(url, json=payload, headers=self._headers(state))
            body = await r.aread()
        except httpx.TimeoutException as e:
            raise _Retryable(f"timeout ({type(e).__name__}) from {state.ep.url}", transport=True) from None
        except (httpx.TransportError, httpx.DecodingError) as e:
            raise _Retryable(f"connection error ({type(e).__name__}) from {state.ep.url}", transport=True) from None
        if r.status_code == 429:
            raise _Retryable(f"HTTP 429 from {state.ep.url}", _retry_after(r.headers))
        if r.status_code >= 500:
            raise _Retryable(f"HTTP {r.status_code} from {state.ep.url}", _retry_after(r.headers))
        if r.status_code >= 400:
            detail = self._redact(body[:300].decode(errors="replace"))  # servers may echo headers
            raise _Fatal(f"HTTP {r.status_code} from {state.ep.url}: {detail}")
        parse = _PARSERS.get(path, parse_chat_response)
        return parse(body, state.ep.url)

    async def request(self, payload: dict, path: str = "/v1/chat/completions") -> ChatResult:
        """POST `payload`, retrying what can be retried; raises RequestFailed when attempts run out."""
        reason = "no attempt made"
        unreachable = False
        request_id = next(self._request_ids)
        for attempt in range(1, self.policy.max_attempts + 1):
            retry_after = None
            state, slot = await self._acquire()  # EndpointsDown propagates: an outage, not this request's failure
            start = time.perf_counter()
            try:
                fields = await self._send_once(state, slot, payload, path)
            except _Retryable as e:
                # A server that does not answer counts every attempt against it; an error
                # answer counts once per request, so one poisoned prompt retried on a
                # healthy server cannot take that server out.
                token = next(self._request_ids) if e.transport else request_id
                reason, retry_after, unreachable = self._redact(e.reason), e.retry_after_s, e.transport
                await self._release(state, slot, token, reason)
            except _Fatal as e:
                await self._release(state, slot, None)  # the endpoint works; the request is bad
                raise RequestFailed(str(e), attempt) from None
            except BaseException:
                await self._release(state, slot, None)
                raise
            else:
                await self._release(state, slot, None)
                return ChatResult(**fields, endpoint=state.ep.url, latency_s=time.perf_counter() - start, attempts=attempt,
                                  server_build=state.build)
            if attempt == self.policy.max_attempts:
                break
            backoff = min(self.policy.backoff_max_s, self.policy.backoff_base_s * 2 ** (attempt - 1))
            delay = self._rng.uniform(0, backoff)  # full jitter
            if retry_after is not None:
                delay = max(delay, min(retry_after, self.policy.backoff_max_s))
            await asyncio.sleep(delay)
        raise RequestFailed(reason, self.policy.max_attempts, unreachable)

    async def chat(self, messages: list[dict], model: str | None = None, **params) -> ChatResult:
        if all(s.ep.kind == "llamacpp" for s in self._states):
            return await self._chat_token_exact(messages, params)
        payload = {"messages": messages, **params}
        if model:
            payload["model"] = model
        return await self.request(payload)

    async def _chat_token_exact(self, messages: list[dict], params: dict) -> ChatResult:
        """A chat turn on llama.cpp with exact ids: its template renders, its tokenizer tokenises, the ids go in.

        The rendered text is tokenised without added specials (the template writes its own), as the
        training side renders it; the result carries the ids sent and the ids sampled.
        """
        template_args = {k: params[k] for k in ("chat_template_kwargs",) if k in params}
        rendered = await self.request({"messages": messages, **template_args}, "/apply-template")
        ids = await self.request({"content": rendered.content, "add_special": False, "parse_special": True},
                                 "/tokenize")
        body = {_LLAMACPP_PARAMS[k]: v for k, v in params.items() if k in _LLAMACPP_PARAMS}
        result = await self.request({"prompt": ids.completion_token_ids, "return_tokens": True, "cache_prompt": True,
                                     **body}, "/completion")
        result.prompt_token_ids = list(ids.completion_token_ids)
        result.prompt_tokens = len(result.prompt_token_ids)
        result.attempts += rendered.attempts + ids.attempts - 2
        return result
