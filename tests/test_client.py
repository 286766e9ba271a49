"""serving.client.ServerPool against real scripted servers (separate processes on loopback ports).

Every server here is `python -m serving.scripted_server` started as a subprocess on a free
127.0.0.1 port, or the same server wrapped by this file (run as a script with
`--recording-server`) so that a test can see what reached it: each request's method, path and
Authorization header, and how many chat requests were in flight at once (GET /_stats).

Tests assert correctness and bounds, never speed. The one elapsed-time check (429 Retry-After) is a
lower bound: a retry must not happen before the server said it may.

"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # when this file runs as the recording server
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import pytest  # noqa: E402

from serving.client import ChatResult, Endpoint, EndpointsDown, RequestFailed, RetryPolicy, ServerPool  # noqa: E402
from serving.llamacpp.server import free_port  # noqa: E402
from serving.scripted_server import answer_for, spawn  # noqa: E402

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

KEY_VAR = "EAGLE3_TEST_CLIENT_API_KEY"
NO_LIMIT = 1 << 30  # what the server uses for max_tokens when none is sent


# ---------------------------------------------------------------- servers as subprocesses


class Servers:
    """Starts scripted servers as subprocesses and kills every one of them at the end of a test."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, port: int | None = None, recording: bool = False, wait_s: float = 15.0) -> str:
        port = port or free_port()
        command = [sys.executable, str(Path(__file__).resolve()), "--recording-server"] if recording else None
        proc, url = spawn(*args, port=port, log_path=self.log_dir / f"server-{port}.log", command=command, wait_s=wait_s)
        self.procs.append(proc)
        return url

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def servers(tmp_path: Path):
    s = Servers(tmp_path)
    try:
        yield s
    finally:
        s.close()


def server_stats(url: str) -> dict:
    """What a recording server saw: `seen` = [[method, path, authorization], ...], `max_inflight`."""
    return httpx.get(url + "/_stats", timeout=5.0).json()


def posts(stats: dict, path: str = "/v1/chat/completions") -> int:
    return sum(1 for m, p, _ in stats["seen"] if m == "POST" and p == path)


def fast_policy(**kw) -> RetryPolicy:
    base = dict(max_attempts=6, backoff_base_s=0.01, backoff_max_s=0.2, connect_timeout_s=2.0,
                read_timeout_s=5.0, eject_after_failures=5, probe_interval_s=0.2)
    return RetryPolicy(**{**base, **kw})


def run(coro, timeout_s: float = 60.0):
    """Run one async scenario, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def settle(pool: ServerPool, msgs: list[dict], **params):
    try:
        return await pool.chat(msgs, **params)
    except RequestFailed as e:
        return e


class TracingPool(ServerPool):
    """A pool that records, per endpoint, the most attempts in flight at once and every retry reason."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.inflight: Counter = Counter()
        self.max_inflight: Counter = Counter()
        self.retry_reasons: list[str] = []

    async def _send_once(self, state, slot, payload, path):
        url = state.ep.url
        self.inflight[url] += 1
        self.max_inflight[url] = max(self.max_inflight[url], self.inflight[url])
        try:
            return await super()._send_once(state, slot, payload, path)
        except Exception as e:
            self.retry_reasons.append(getattr(e, "reason", str(e)))
            raise
        finally:
            self.inflight[url] -= 1


# ---------------------------------------------------------------- (a) mixed faults


@pytest.mark.timeout(120)
def test_mixed_faults_each_prompt_gets_its_own_answer_or_a_reason(servers):
    url = servers.start(
        "--fail-500", "0.04", "--fail-429", "0.04", "--retry-after", "0.05",
        "--hang", "0.03", "--hang-s", "3", "--reset", "0.03", "--malformed", "0.03", "--truncated", "0.03",
        "--seed", "7",
    )  # 20% of attempts fail, one way or another
    policy = fast_policy(max_attempts=6, read_timeout_s=0.5)
    jobs: list[tuple[list[dict], int | None]] = []
    for i in range(200):
        if i == 13:
            jobs.append((user(f"prompt {i} POISON"), None))
        elif i == 17:
            jobs.append((user(f"prompt {i} EMPTY"), None))
        elif i % 5 == 0:
            jobs.append((user(f"prompt {i}, cut short"), 5))
        elif i % 7 == 0:
            jobs.append(([{"role": "system", "content": "be brief ✓"}, {"role": "user", "content": f"héllo {i}"}], None))
        else:
            jobs.append((user(f"prompt {i}"), None))

    async def main():
        async with TracingPool([Endpoint(url, max_concurrency=16)], policy, seed=1) as pool:
            out = await asyncio.gather(*(settle(pool, m, **({"max_tokens": t} if t else {})) for m, t in jobs))
            return out, pool

    results, pool = run(main(), 100)
    assert len(results) == 200
    unexpected_failures = []
    for i, ((msgs, max_tokens), r) in enumerate(zip(jobs, results)):
        if i == 13:
            assert isinstance(r, RequestFailed), "a POISON prompt must fail"
            assert "HTTP 500" in r.reason and "HTTP 500" in str(r)
            assert r.attempts == policy.max_attempts
            continue
        if isinstance(r, RequestFailed):
            assert r.reason and r.attempts == policy.max_attempts  # only an exhausted request fails
            unexpected_failures.append((i, r.reason))
            continue
        assert isinstance(r, ChatResult)
        content, finish = answer_for(msgs, max_tokens or NO_LIMIT)
        if i == 17:
            content, finish = "", "stop"
        assert r.content == content, f"prompt {i} got another prompt's answer or a damaged one"
        assert r.finish_reason == finish
        assert r.served_model == "scripted-model" and r.endpoint == url
        assert 1 <= r.attempts <= policy.max_attempts
    # P(6 faults in a row) = 0.2**6: a healthy retry loop loses at most a couple of 200 prompts.
    assert len(unexpected_failures) <= 2, unexpected_failures
    # Every fault kind was injected and classified as retryable, with a reason naming it.
    reasons = pool.retry_reasons
    assert len(reasons) >= 20, reasons  # about 20% of about 250 attempts, plus 6 POISON ones
    for kind in ("HTTP 500", "HTTP 429", "timeout", "connection error", "malformed JSON"):
        assert any(kind in r for r in reasons), f"no retry for {kind!r} in {Counter(reasons)}"
    assert sum(r.attempts for r in results if isinstance(r, ChatResult)) > 199  # some prompts were retried


# ---------------------------------------------------------------- (b) 429 and Retry-After


@pytest.mark.timeout(60)
def test_retry_after_is_honoured_before_each_retry(servers):
    retry_after = 0.3
    url = servers.start("--fail-429", "1.0", "--retry-after", str(retry_after))
    # Backoff so small that only Retry-After can make the retries wait.
    policy = fast_policy(max_attempts=3, backoff_base_s=0.001, backoff_max_s=5.0)

    async def main():
        async with ServerPool([Endpoint(url, max_concurrency=2)], policy, seed=0) as pool:
            t0 = time.perf_counter()
            with pytest.raises(RequestFailed) as ei:
                await pool.chat(user("please"))
            return time.perf_counter() - t0, ei.value, pool

    elapsed, err, pool = run(main())
    assert "HTTP 429" in err.reason
    assert err.attempts == 3 and pool.stats.requests[url] == 3
    # A lower bound, not a speed check: two retries, each no earlier than Retry-After.
    assert elapsed >= retry_after * (err.attempts - 1)


# ---------------------------------------------------------------- (c) ejection and probing back


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad_kind", ["refused", "always-500"])
def test_a_bad_endpoint_is_ejected_and_the_good_one_serves_everything(servers, bad_kind):
    good = servers.start()
    bad = f"http://127.0.0.1:{free_port()}" if bad_kind == "refused" else servers.start("--fail-500", "1.0")
    policy = fast_policy(eject_after_failures=3, probe_interval_s=60.0)  # stays out for the whole test

    async def main():
        async with ServerPool([Endpoint(bad, max_concurrency=4), Endpoint(good, max_concurrency=4)], policy, seed=3) as pool:
            out = await asyncio.gather(*(settle(pool, user(f"q{i}")) for i in range(100)))
            return out, pool

    results, pool = run(main())
    assert all(isinstance(r, ChatResult) for r in results), [r for r in results if not isinstance(r, ChatResult)]
    assert all(r.endpoint == good for r in results)
    assert all(r.content == answer_for(user(f"q{i}"), NO_LIMIT)[0] for i, r in enumerate(results))
    assert pool.stats.ejections == 1
    # After ejection the bad endpoint gets nothing more than what was already in flight.
    assert 3 <= pool.stats.failures[bad] <= 3 + 4


@pytest.mark.timeout(60)
def test_an_ejected_endpoint_that_comes_back_receives_requests_again(servers):
    good = servers.start()
    port = free_port()
    back = f"http://127.0.0.1:{port}"  # nothing listens yet
    policy = fast_policy(eject_after_failures=3, probe_interval_s=0.3)

    async def main():
        async with ServerPool([Endpoint(good, max_concurrency=4), Endpoint(back, max_concurrency=4)], policy, seed=5) as pool:
            first = await asyncio.gather(*(settle(pool, user(f"a{i}")) for i in range(40)))
            ejections = pool.stats.ejections
            await asyncio.to_thread(servers.start, port=port, recording=True)
            served_by_back = 0
            later: list = []
            deadline = time.monotonic() + 15
            for batch in range(100):  # bounded in count and time
                rs = await asyncio.gather(*(settle(pool, user(f"b{batch}-{i}")) for i in range(8)))
                later += rs
                served_by_back += sum(1 for r in rs if isinstance(r, ChatResult) and r.endpoint == back)
                if served_by_back >= 5 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            return first, ejections, later, served_by_back

    first, ejections, later, served_by_back = run(main())
    assert all(isinstance(r, ChatResult) and r.endpoint == good for r in first)
    assert ejections >= 1
    assert all(isinstance(r, ChatResult) for r in later)
    assert served_by_back >= 5
    assert posts(server_stats(back)) >= served_by_back


@pytest.mark.timeout(60)
def test_when_every_endpoint_is_out_a_models_probe_brings_one_back(servers):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    policy = fast_policy(max_attempts=6, eject_after_failures=2, probe_interval_s=0.2)

    async def main():
        async with ServerPool([Endpoint(url, max_concurrency=2)], policy, seed=0) as pool:
            task = asyncio.create_task(pool.chat(user("wait for me")))
            for _ in range(200):  # until the endpoint is out (bounded)
                if pool.stats.ejections or task.done():
                    break
                await asyncio.sleep(0.01)
            assert pool.stats.ejections == 1 and not task.done()
            await asyncio.to_thread(servers.start, port=port, recording=True)
            return await task

    r = run(main())
    assert r.content == answer_for(user("wait for me"), NO_LIMIT)[0]
    # two refused (the endpoint is then out), then one that worked after the probe: waiting for
    # the probe is no attempt, however slowly the server starts (inside the outage window)
    assert r.attempts == 3
    seen = [(m, p) for m, p, _ in server_stats(url)["seen"]]
    assert ("GET", "/v1/models") in seen
    assert seen.index(("GET", "/v1/models")) < seen.index(("POST", "/v1/chat/completions"))


@pytest.mark.timeout(60)
def test_an_ejected_endpoint_that_stays_dead_gets_no_more_real_requests(servers):
    good = servers.start()
    dead = f"http://127.0.0.1:{free_port()}"
    policy = fast_policy(eject_after_failures=3, probe_interval_s=0.1)

    async def main():
        async with ServerPool([Endpoint(good, max_concurrency=4), Endpoint(dead, max_concurrency=4)], policy, seed=2) as pool:
            deadline = time.monotonic() + 1.5
            for batch in range(200):  # bounded in count and time
                rs = await asyncio.gather(*(settle(pool, user(f"d{batch}-{i}")) for i in range(8)))
                assert all(isinstance(r, ChatResult) for r in rs)
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            return pool.stats

    stats = run(main())
    # Observed with the current client: ejections ~ 10-15 and failures ~ 30-60 in 1.5 s.
    assert stats.ejections == 1, f"ejections={stats.ejections} failures={stats.failures}"
    assert stats.failures[dead] <= 3 + 4


@pytest.mark.timeout(60)
def test_an_ejected_endpoint_is_readmitted_only_after_a_models_probe(servers):
    good = servers.start()
    port = free_port()
    back = f"http://127.0.0.1:{port}"
    policy = fast_policy(eject_after_failures=3, probe_interval_s=0.2)

    async def main():
        async with ServerPool([Endpoint(good, max_concurrency=4), Endpoint(back, max_concurrency=4)], policy, seed=5) as pool:
            await asyncio.gather(*(settle(pool, user(f"a{i}")) for i in range(40)))
            assert pool.stats.ejections >= 1
            await asyncio.to_thread(servers.start, port=port, recording=True)
            deadline = time.monotonic() + 5
            for batch in range(100):
                rs = await asyncio.gather(*(settle(pool, user(f"b{batch}-{i}")) for i in range(8)))
                if any(isinstance(r, ChatResult) and r.endpoint == back for r in rs) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)

    run(main())
    seen = [(m, p) for m, p, _ in server_stats(back)["seen"]]
    assert seen and seen[0] == ("GET", "/v1/models"), f"first requests to the returning endpoint: {seen[:5]}"


# ---------------------------------------------------------------- (d) balancing and concurrency limits


@pytest.mark.timeout(60)
def test_two_equal_endpoints_share_the_load_fairly(servers):
    a = servers.start("--latency", "0.005")
    b = servers.start("--latency", "0.005")

    async def main():
        async with ServerPool([Endpoint(a, max_concurrency=8), Endpoint(b, max_concurrency=8)], fast_policy(), seed=11) as pool:
            return await asyncio.gather(*(pool.chat(user(f"x{i}")) for i in range(400))), pool

    results, pool = run(main())
    by_endpoint = Counter(r.endpoint for r in results)
    assert set(by_endpoint) == {a, b}
    assert min(by_endpoint.values()) > 0.30 * len(results), by_endpoint
    assert pool.stats.requests == {a: by_endpoint[a], b: by_endpoint[b]}


@pytest.mark.timeout(60)
def test_the_per_endpoint_concurrency_limit_is_never_exceeded(servers):
    a = servers.start("--latency", "0.02", recording=True)
    b = servers.start("--latency", "0.02", recording=True)
    limits = {a: 3, b: 5}

    async def main():
        eps = [Endpoint(u, max_concurrency=n) for u, n in limits.items()]
        async with TracingPool(eps, fast_policy(), seed=4) as pool:
            rs = await asyncio.gather(*(pool.chat(user(f"c{i}")) for i in range(240)))
            return rs, pool

    results, pool = run(main())
    assert len(results) == 240
    for u, n in limits.items():
        assert pool.max_inflight[u] == n, (u, pool.max_inflight)  # reached, never passed (client side)
        s = server_stats(u)
        assert 1 <= s["max_inflight"] <= n, (u, s["max_inflight"])  # never passed (server side)
        assert posts(s) == pool.stats.requests[u]


# ---------------------------------------------------------------- (e) API keys


@pytest.mark.timeout(60)
def test_the_api_key_reaches_the_server_and_nowhere_else(servers, monkeypatch, caplog, capfd):
    secret = "sk-test-" + secrets.token_hex(12)
    monkeypatch.setenv(KEY_VAR, secret)
    caplog.set_level(logging.DEBUG)  # httpx and httpcore at their most talkative
    url = servers.start(recording=True)
    dead = f"http://127.0.0.1:{free_port()}"
    ep = Endpoint(url, max_concurrency=4, api_key_env=KEY_VAR)
    dead_ep = Endpoint(dead, max_concurrency=4, api_key_env=KEY_VAR)
    texts: list[str] = [repr(ep), str(ep), repr(dead_ep)]

    async def main():
        async with ServerPool([ep], fast_policy(max_attempts=2), seed=0) as pool:
            ok = await asyncio.gather(*(pool.chat(user(f"k{i}")) for i in range(5)))
            texts.extend(repr(r) for r in ok)
            texts.append(repr(pool.stats))
            for make in (lambda: pool.chat(user("POISON")), lambda: pool.request({"messages": user("x")}, path="/v1/nope")):
                with pytest.raises(RequestFailed) as ei:
                    await make()
                texts.extend([str(ei.value), repr(ei.value), ei.value.reason])
        async with ServerPool([dead_ep], fast_policy(max_attempts=2, eject_after_failures=10), seed=0) as pool:
            with pytest.raises(RequestFailed) as ei:
                await pool.chat(user("nobody home"))
            texts.extend([str(ei.value), repr(ei.value), ei.value.reason])

    run(main())
    seen = server_stats(url)["seen"]
    chat_auth = [auth for m, p, auth in seen if m == "POST"]
    assert len(chat_auth) == 5 + 2 + 1  # five answers, POISON twice, the 404 once
    assert all(auth == f"Bearer {secret}" for auth in chat_auth)
    out, err = capfd.readouterr()
    assert caplog.records, "expected httpx/httpcore log records to inspect"
    for where, text in [*(("message", t) for t in texts), ("logs", caplog.text), ("stdout", out), ("stderr", err)]:
        assert secret not in text, f"the API key leaked into {where}"


@pytest.mark.timeout(60)
def test_a_missing_key_variable_is_named_in_a_clear_error(monkeypatch):
    monkeypatch.delenv("EAGLE3_TEST_MISSING_KEY", raising=False)

    async def main():
        async with ServerPool([Endpoint("http://127.0.0.1:9", api_key_env="EAGLE3_TEST_MISSING_KEY")], fast_policy()):
            pass

    with pytest.raises(RequestFailed) as ei:
        run(main())
    assert "EAGLE3_TEST_MISSING_KEY" in str(ei.value) and "not set" in str(ei.value)
    assert ei.value.attempts == 0


@pytest.mark.timeout(60)
def test_a_server_echoing_the_key_in_an_error_does_not_leak_it(servers, monkeypatch):
    secret = "sk-test-" + secrets.token_hex(12)
    monkeypatch.setenv(KEY_VAR, secret)
    url = servers.start("--echo-auth-401", recording=True)

    async def main():
        async with ServerPool([Endpoint(url, api_key_env=KEY_VAR)], fast_policy()) as pool:
            with pytest.raises(RequestFailed) as ei:
                await pool.chat(user("hello"))
            return ei.value

    err = run(main())
    assert "HTTP 401" in err.reason and err.attempts == 1
    assert secret not in str(err)


# ---------------------------------------------------------------- (f) 4xx is not retried


@pytest.mark.timeout(60)
def test_a_404_is_not_retried(servers):
    url = servers.start(recording=True)

    async def main():
        async with ServerPool([Endpoint(url)], fast_policy(max_attempts=6), seed=0) as pool:
            with pytest.raises(RequestFailed) as ei:
                await pool.request({"messages": user("x")}, path="/v1/no-such-path")
            ok = await pool.chat(user("after"))  # a bad request does not count against the endpoint
            return ei.value, ok, pool.stats

    err, ok, stats = run(main())
    assert err.attempts == 1 and "HTTP 404" in err.reason
    assert posts(server_stats(url), "/v1/no-such-path") == 1
    assert ok.content == answer_for(user("after"), NO_LIMIT)[0]
    assert stats.failures.get(url, 0) == 0 and stats.ejections == 0


# ---------------------------------------------------------------- the recording server


def _recording_server_main(argv: list[str]) -> None:
    """The scripted server, plus a record of what reached it (GET /_stats) and --echo-auth-401."""
    from serving import scripted_server as ss

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--echo-auth-401", action="store_true")
    opts, rest = extra.parse_known_args(argv)
    args = ss.parse_args(rest)

    class Recording(ss.Scripted):
        def __init__(self, a):
            super().__init__(a)
            self.seen: list[list] = []
            self.inflight = 0
            self.max_inflight = 0

        async def respond(self, method, path, headers, body, writer):  # Scripted.respond, recorded
            if path == "/_stats":
                return await self.send(writer, 200, json.dumps({"seen": self.seen, "max_inflight": self.max_inflight}).encode())
            if path != "/health":
                self.seen.append([method, path, headers.get("authorization")])
            if opts.echo_auth_401 and method == "POST":
                msg = json.dumps({"error": f"invalid api key: {headers.get('authorization')}"}).encode()
                return await self.send(writer, 401, msg)
            self.inflight += method == "POST"
            self.max_inflight = max(self.max_inflight, self.inflight)
            try:
                return await super().respond(method, path, headers, body, writer)
            finally:
                self.inflight -= method == "POST"

    async def serve() -> None:
        server = await asyncio.start_server(Recording(args).handle, "127.0.0.1", args.port, backlog=1024)
        print(f"recording scripted server on 127.0.0.1:{args.port}", flush=True)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__" and sys.argv[1:2] == ["--recording-server"]:
    _recording_server_main(sys.argv[2:])


# ---------------------------------------------------------------- outages and unreachable servers


@pytest.mark.timeout(60)
def test_every_endpoint_down_past_the_window_raises_one_named_error_not_request_failures(servers):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    policy = fast_policy(eject_after_failures=2, probe_interval_s=0.2, outage_window_s=1.0)

    async def main():
        async with ServerPool([Endpoint(u, max_concurrency=2) for u in dead], policy, seed=1) as pool:
            started = time.monotonic()
            results = await asyncio.gather(*(pool.chat(user(f"q{i}")) for i in range(6)), return_exceptions=True)
            return results, time.monotonic() - started

    results, took = run(main())
    assert all(isinstance(r, EndpointsDown) for r in results), results  # no request counts as failed
    message = str(results[0])
    assert all(u in message for u in dead) and "connection error" in message and "1 s" in message
    assert 1.0 <= took < 10


@pytest.mark.timeout(60)
def test_a_request_whose_last_attempt_reached_no_server_is_marked_unreachable(servers):
    failing = servers.start("--fail-500", "1.0")
    dead = f"http://127.0.0.1:{free_port()}"
    policy = fast_policy(max_attempts=2, eject_after_failures=1000)  # never ejected: attempts run out first

    async def main(url):
        async with ServerPool([Endpoint(url)], policy) as pool:
            return await settle(pool, user("q"))

    unreachable, answered = run(main(dead)), run(main(failing))
    assert isinstance(unreachable, RequestFailed) and unreachable.unreachable
    assert isinstance(answered, RequestFailed) and not answered.unreachable and "HTTP 500" in answered.reason
