"""A scripted OpenAI-compatible server, run as a real process on loopback, for tests and benchmarks.

It does on demand what a real server does only on a bad day: fails a configurable share of
requests with 500s, 429s with Retry-After, hangs past the client's timeout, resets connections,
sends malformed JSON or a body cut short. It can also answer at once (client-overhead benchmark)
or with a fixed latency and N slots (saturation benchmark). Answers are deterministic functions of
the request, so a test knows what each prompt must produce. A prompt containing `POISON` always
fails with 500: the way to test the recorded-failure path.

Run: python -m serving.scripted_server --port 8123 --fail-500 0.1 --fail-429 0.05 ...
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
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


class Scripted:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.slots = asyncio.Semaphore(args.slots) if args.slots > 0 else None
        self.requests = 0

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
        if method == "GET" and path in ("/health", "/v1/models"):
            payload = {"object": "list", "data": [{"id": self.args.model}]} if path == "/v1/models" else {"ok": True}
            return await self.send(writer, 200, json.dumps(payload).encode())
        if method == "POST" and path == "/generate":  # SGLang's native API: token ids and meta_info
            req = json.loads(body)
            ids = [int(x, 16) for x in answer_for([{"role": "user", "content": req.get("text", "")}], 1 << 30)[0].split()]
            n = int((req.get("sampling_params") or {}).get("max_new_tokens") or len(ids))
            out = {"text": " ".join(map(str, ids[:n])), "output_ids": ids[:n], "meta_info": {
                "prompt_tokens": len(req.get("text", "").split()), "completion_tokens": min(n, len(ids)),
                "finish_reason": {"type": "length" if n < len(ids) else "stop"}}}
            return await self.send(writer, 200, json.dumps(out).encode())
        if method != "POST" or path != "/v1/chat/completions":
            return await self.send(writer, 404, b'{"error": "not found"}')
        self.requests += 1
        req = json.loads(body)
        messages = req.get("messages", [])
        if any("POISON" in str(m.get("content", "")) for m in messages):
            return await self.send(writer, 500, b'{"error": "poisoned prompt"}')
        fault = self.pick_fault()
        if fault == "fail_500":
            return await self.send(writer, 500, b'{"error": "injected"}')
        if fault == "fail_429":
            return await self.send(writer, 429, b'{"error": "slow down"}', {"Retry-After": str(self.args.retry_after)})
        if fault == "hang":
            await asyncio.sleep(self.args.hang_s)
            return False
        if fault == "reset":
            sock = writer.get_extra_info("socket")
            if sock is not None:  # SO_LINGER 0: close sends RST, the client sees a reset
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        content, finish = answer_for(messages, int(req.get("max_tokens") or 1 << 30))
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
        if self.slots is not None:
            async with self.slots:
                await asyncio.sleep(self.args.latency)
        elif self.args.latency:
            await asyncio.sleep(self.args.latency)
        if fault == "malformed":
            return await self.send(writer, 200, out[: len(out) // 2] + b"}{not json")
        if fault == "truncated":
            writer.write(self.head(200, len(out)) + out[: len(out) // 2])
            await writer.drain()
            writer.close()
            return False
        return await self.send(writer, 200, out)

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

    from serving.launch import free_port

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
    p.add_argument("--empty-marker", default="EMPTY", help="prompts containing it get an empty answer")
    return p.parse_args(argv)


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
