"""A scripted OpenAI-compatible server, run as a real process on loopback, for tests and benchmarks.

It does on demand what a real server does only on a bad day: fails a configurable share of
requests with 500s, 429s with Retry-After, hangs past the client's timeout, resets connections,
sends malformed JSON or a body cut short. It can also answer at once (client-overhead benchmark)
or with a fixed latency and N slots (saturation benchmark). Answers are deterministic functions of
the request, so a test knows what each prompt must produce. A prompt containing `POISON` always
fails with 500: the way to test the recorded-failure path.

SGLang's native `/generate` (text or input_ids, sampling_params, stream) answers like SGLang:
`meta_info` with `completion_tokens`, and with `--spec-accept-length A` the speculative fields
(`spec_verify_ct` = completion_tokens / A rounded, `spec_accept_rate`, `spec_accept_length`) on the
finished response, as SGLang sets them. Time is modelled per forward step (`--step-latency`): one
token per step without speculation, one verify round (A tokens on average) per step with it, so
tokens/s scales with acceptance. Streaming sends one SSE event per step, then `data: [DONE]`.
`--spec-missing-verify-ct` speculates but leaves the spec_* fields out (a server that did not).
A /generate prompt may carry `accept=X` (this request's acceptance length) and `len=N` (its
answer ends after N tokens, like an EOS) to build uneven cases.

Like a production baseline (`--answer-lengths FILE --tokens-per-s R --slots S`): each chat answer
is as long as a length drawn from FILE (one integer per line, e.g. real answer lengths; the draw is
a hash of the conversation, so a retry gets the same answer), and takes `length / R` seconds in
one of S slots (requests beyond S queue, as a server's scheduler queues them). `--time-scale F`
runs F times faster than that (a rehearsal compressed in time). GET /metrics reports the slot-time
kept busy, so a client's saturation of the server can be measured from the server's side.

Run: python -m serving.scripted_server --port 8123 --fail-500 0.1 --fail-429 0.05 ...
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

FAULTS = ("fail_500", "fail_429", "hang", "reset", "malformed", "truncated")


def answer_for(messages: list[dict], max_tokens: int) -> tuple[str, str]:
    """The deterministic completion for a conversation, and its finish reason."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
    words = [digest[i : i + 4] for i in range(0, 64, 4)]  # 16 "tokens"
    if max_tokens < len(words):
        return " ".join(words[:max_tokens]), "length"
    return " ".join(words), "stop"


def long_answer(messages: list[dict], n: int) -> str:
    """A deterministic answer of exactly `n` words: `answer_for`'s 16, then more from a hash chain."""
    words = answer_for(messages, 1 << 30)[0].split()
    seed = hashlib.sha256(" ".join(words).encode()).digest()
    while len(words) < n:
        seed = hashlib.sha256(seed).digest()
        words += [seed[i : i + 2].hex() for i in range(0, 32, 2)]
    return " ".join(words[:n])


def drawn_length(messages: list[dict], lengths: list[int]) -> int:
    """The answer length this conversation draws from `lengths` (the same on every retry)."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
    return lengths[int.from_bytes(digest[:8], "big") % len(lengths)]


def answer_ids(text: str, n: int = 16) -> list[int]:
    """The /generate answer for a prompt as token ids: the 16 of `answer_for`, then more from a hash chain."""
    ids = [int(x, 16) for x in answer_for([{"role": "user", "content": text}], 1 << 30)[0].split()]
    seed = hashlib.sha256(text.encode()).digest()
    while len(ids) < n:
        seed = hashlib.sha256(seed).digest()
        ids += [int.from_bytes(seed[i : i + 2], "big") for i in range(0, 32, 2)]
    return ids[:max(n, 16)]


def _directive(text: str, name: str) -> str | None:
    match = re.search(rf"\b{name}=([0-9.]+)", text)
    return match.group(1) if match else None


def round_sizes(n: int, accept_length: float) -> list[int]:
    """Tokens per verify round: `round(n / A)` rounds sharing n tokens as evenly as integers allow."""
    if n <= 0:
        return []
    rounds = min(n, max(1, math.floor(n / accept_length + 0.5)))
    return [n * (i + 1) // rounds - n * i // rounds for i in range(rounds)]


class Scripted:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.slots = asyncio.Semaphore(args.slots) if args.slots > 0 else None
        self.requests = 0
        self.lengths = [int(x) for x in Path(args.answer_lengths).read_text().split()] if args.answer_lengths else None
        # Slot accounting for /metrics: the integral of busy slots over time, updated at each change.
        self.started = time.monotonic()
        self.busy_now = self.waiting = self.completed = self.faults = 0
        self.busy_slot_s = 0.0
        self.last_change = self.started

    def _busy(self, delta: int) -> None:
        now = time.monotonic()
        self.busy_slot_s += self.busy_now * (now - self.last_change)
        self.busy_now += delta
        self.last_change = now

    def metrics(self) -> dict:
        self._busy(0)
        return {"slots": self.args.slots, "up_s": time.monotonic() - self.started, "busy_slot_s": self.busy_slot_s,
                "busy_now": self.busy_now, "waiting": self.waiting, "requests": self.requests,
                "completed": self.completed, "faults": self.faults}

    async def serve_slot(self, seconds: float) -> None:
        """Hold one slot for `seconds` (after queueing for it when all are busy)."""
        if self.slots is None:
            if seconds:
                await asyncio.sleep(seconds)
            return
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        self._busy(+1)
        try:
            await asyncio.sleep(seconds)
        finally:
            self._busy(-1)
            self.slots.release()

    def pick_fault(self) -> str | None:
        x = self.rng.random()
        for name in FAULTS:
            share = getattr(self.args, name)
            if x < share:
                return name
            x -= share
        return None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self.respond(method, path, headers, body, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            if not writer.is_closing():
                writer.close()

    async def respond(self, method: str, path: str, headers: dict, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Write one response; False when the connection must end (a fault closed it)."""
        if method == "GET" and path == "/metrics":
            return await self.send(writer, 200, json.dumps(self.metrics()).encode())
        if method == "GET" and path in ("/health", "/v1/models"):
            payload = {"object": "list", "data": [{"id": self.args.model}]} if path == "/v1/models" else {"ok": True}
            return await self.send(writer, 200, json.dumps(payload).encode())
        if method == "POST" and path == "/generate":  # SGLang's native API: token ids and meta_info
            return await self.generate(json.loads(body), writer)
        if method != "POST" or path != "/v1/chat/completions":
            return await self.send(writer, 404, b'{"error": "not found"}')
        self.requests += 1
        req = json.loads(body)
        messages = req.get("messages", [])
        if any("POISON" in str(m.get("content", "")) for m in messages):
            return await self.send(writer, 500, b'{"error": "poisoned prompt"}')
        fault = self.pick_fault()
        self.faults += fault is not None
        if fault == "fail_500":
            return await self.send(writer, 500, b'{"error": "injected"}')
        if fault == "fail_429":
            return await self.send(writer, 429, b'{"error": "slow down"}', {"Retry-After": str(self.args.retry_after)})
        if fault == "hang":
            await asyncio.sleep(self.args.hang_s / self.args.time_scale)
            return False
        if fault == "reset":
            sock = writer.get_extra_info("socket")
            if sock is not None:  # SO_LINGER 0: close sends RST, the client sees a reset
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        max_tokens = int(req.get("max_tokens") or 1 << 30)
        service_s = self.args.latency
        if self.lengths is not None:
            n = drawn_length(messages, self.lengths)
            content, finish = long_answer(messages, min(n, max_tokens)), "length" if n > max_tokens else "stop"
            service_s += min(n, max_tokens) / self.args.tokens_per_s
        else:
            content, finish = answer_for(messages, max_tokens)
        service_s /= self.args.time_scale
        if self.args.empty_marker and any(self.args.empty_marker in str(m.get("content", "")) for m in messages):
            content, finish = "", "stop"
        out = json.dumps({
            "id": f"cmpl-{self.requests}",
            "object": "chat.completion",
            "model": self.args.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
            "usage": {"prompt_tokens": sum(len(str(m.get("content", "")).split()) for m in messages),
                      "completion_tokens": len(content.split()), "total_tokens": 0},
        }).encode()
        await self.serve_slot(service_s)
        if fault == "malformed":
            return await self.send(writer, 200, out[: len(out) // 2] + b"}{not json")
        if fault == "truncated":
            writer.write(self.head(200, len(out)) + out[: len(out) // 2])
            await writer.drain()
            writer.close()
            return False
        self.completed += 1
        return await self.send(writer, 200, out)

    async def generate(self, req: dict, writer: asyncio.StreamWriter) -> bool:
        """SGLang /generate: the answer in steps (one token, or one verify round when speculating)."""
        started = time.monotonic()
        text = req.get("text")
        if text is None:  # input_ids: the ids stand for the prompt
            text = " ".join(map(str, req.get("input_ids") or []))
        params = req.get("sampling_params") or {}
        length = int(_directive(text, "len") or self.args.answer_tokens)
        ids = answer_ids(text, length)[:length]
        if params.get("ignore_eos") and params.get("max_new_tokens"):
            ids = answer_ids(text, int(params["max_new_tokens"]))
        n = int(params.get("max_new_tokens") or len(ids))
        finish = {"type": "length" if n < len(ids) else "stop"}
        ids = ids[:n]
        accept = float(_directive(text, "accept") or self.args.spec_accept_length)
        speculative = self.args.spec_accept_length > 0
        steps = round_sizes(len(ids), accept) if speculative else [1] * len(ids)
        meta = {"id": f"gen-{self.requests}", "prompt_tokens": len(text.split())}

        def final_meta() -> dict:
            out = {**meta, "completion_tokens": len(ids), "finish_reason": finish,
                   "e2e_latency": time.monotonic() - started}
            if speculative and not self.args.spec_missing_verify_ct:  # as SGLang's tokenizer manager sets them
                verify, drafts = len(steps), len(steps) * (self.args.spec_num_draft_tokens - 1)
                out.update(spec_verify_ct=verify, spec_accept_length=len(ids) / verify if verify else 0,
                           spec_accept_rate=(len(ids) - verify) / drafts if drafts else 0.0,
                           spec_accept_token_num=len(ids) - verify, spec_draft_token_num=drafts)
            return out

        if self.args.prefill_latency:
            await asyncio.sleep(self.args.prefill_latency)
        if not req.get("stream"):
            if self.args.step_latency:
                await asyncio.sleep(self.args.step_latency * len(steps))
            out = {"text": " ".join(map(str, ids)), "output_ids": ids, "meta_info": final_meta()}
            return await self.send(writer, 200, json.dumps(out).encode())
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        done = 0
        for i, size in enumerate(steps or [0]):
            if self.args.step_latency:
                await asyncio.sleep(self.args.step_latency)
            done += size
            last = i == len(steps) - 1 or not steps
            chunk_meta = final_meta() if last else {**meta, "completion_tokens": done, "finish_reason": None}
            # SGLang's default (non-incremental) stream: text and output_ids so far, in every event
            event = {"text": " ".join(map(str, ids[:done])), "output_ids": ids[:done], "meta_info": chunk_meta}
            await self.send_chunk(writer, b"data: " + json.dumps(event).encode() + b"\n\n")
        await self.send_chunk(writer, b"data: [DONE]\n\n")
        await self.send_chunk(writer, b"")  # the last chunk of a chunked body
        return True

    @staticmethod
    async def send_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    @staticmethod
    def head(status: int, length: int, extra: dict | None = None) -> bytes:
        reason = {200: "OK", 401: "Unauthorized", 404: "Not Found", 429: "Too Many Requests",
                  500: "Internal Server Error"}[status]
        lines = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {length}"]
        lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def send(self, writer: asyncio.StreamWriter, status: int, body: bytes, extra: dict | None = None) -> bool:
        writer.write(self.head(status, len(body), extra) + body)
        await writer.drain()
        return True


def spawn(*args: str, port: int | None = None, log_path: Path | None = None, command: list[str] | None = None,
          wait_s: float = 20.0) -> tuple[subprocess.Popen, str]:
    """Start the server as a real process on a loopback port; return it and its URL once /health answers.

    `command` replaces `python -m serving.scripted_server` (a test's own wrapper of it). The wait is
    bounded in time; a process that exits or never answers is killed and the error carries its log.
    """
    import httpx

    from serving.llamacpp.server import free_port

    port = port or free_port()
    root = Path(__file__).resolve().parent.parent
    cmd = (command or [sys.executable, "-m", "serving.scripted_server"]) + ["--port", str(port), *args]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(root)})
    if log_path:
        log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    detail = Path(log_path).read_text(errors="replace")[-2000:] if log_path else ""
    raise RuntimeError(f"scripted server on port {port} exited ({proc.returncode}) or did not answer /health "
                       f"within {wait_s} s {detail}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="scripted-model")
    p.add_argument("--seed", type=int, default=0)
    for name in FAULTS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=float, default=0.0, help="share of requests")
    p.add_argument("--retry-after", type=float, default=0.2, help="Retry-After seconds sent with 429")
    p.add_argument("--hang-s", type=float, default=30.0, help="how long a hung request stalls")
    p.add_argument("--latency", type=float, default=0.0, help="seconds per answer")
    p.add_argument("--slots", type=int, default=0, help="answers in parallel (0: unlimited)")
    p.add_argument("--answer-lengths", default=None,
                   help="chat: a file of answer lengths in tokens (one per line); each answer draws one")
    p.add_argument("--tokens-per-s", type=float, default=90.0, help="chat with --answer-lengths: one stream's pace")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="run this many times faster (service times and --hang-s are divided by it)")
    p.add_argument("--empty-marker", default="EMPTY", help="prompts containing it get an empty answer")
    p.add_argument("--answer-tokens", type=int, default=16, help="/generate: answer length before its stop")
    p.add_argument("--step-latency", type=float, default=0.0,
                   help="/generate: seconds per forward step (a token, or a verify round when speculating)")
    p.add_argument("--prefill-latency", type=float, default=0.0, help="/generate: seconds before the first step")
    p.add_argument("--spec-accept-length", type=float, default=0.0,
                   help="/generate speculates with this acceptance length (tokens per verify round; 0: off)")
    p.add_argument("--spec-num-draft-tokens", type=int, default=4, help="for spec_accept_rate, as SGLang computes it")
    p.add_argument("--spec-missing-verify-ct", action="store_true",
                   help="speculate but leave spec_verify_ct (and the other spec_* fields) out of meta_info")
    args = p.parse_args(argv)
    if args.spec_accept_length and args.spec_accept_length < 1:
        p.error("--spec-accept-length is at least 1 (every verify round yields a token)")
    return args


async def serve(args: argparse.Namespace) -> None:
    scripted = Scripted(args)
    server = await asyncio.start_server(scripted.handle, "127.0.0.1", args.port, backlog=1024)
    print(f"scripted server on 127.0.0.1:{args.port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(serve(parse_args()))
    except KeyboardInterrupt:
        pass
