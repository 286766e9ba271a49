"""A caching reverse proxy in front of the baseline server, so study arms share the target's answers.

The selection study (benchmarks/studies/selection.py) runs each arm's own `regenerate` (its own
selection, its own lineage) against this proxy. An answer another arm already asked for comes from
the cache, byte for byte the same, so arms differ only in which prompts they choose, and each
answer is computed once. What is cached: POST /completion and /v1/chat/completions whose request
asks for greedy decoding (temperature 0), keyed by path and body. Everything else passes through.
A cached answer is written to a temporary file and renamed: a killed proxy leaves no torn entry.
`pack` / `unpack` (and `--seed`) carry the cache from one machine to the next as one gzipped file.

    .venv/bin/python -m benchmarks.studies.answer_cache --upstream http://127.0.0.1:8090 --port 8091 --cache runs/selection/answers
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

CACHED_PATHS = ("/completion", "/v1/chat/completions")


class Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hits = self.misses = self.passed = 0

    def add(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)


def cache_key(path: str, body: bytes) -> str | None:
    """The entry of a request, or None when it must not be cached (not greedy, or not an answer)."""
    if path not in CACHED_PATHS:
        return None
    try:
        req = json.loads(body)
    except ValueError:
        return None
    if not isinstance(req, dict) or req.get("temperature", 1.0) != 0 or req.get("stream"):
        return None
    return hashlib.sha256(path.encode() + b"\0" + body).hexdigest()


def make_handler(upstream: str, cache: Path, counters: Counters):
    up = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the study prints its own progress
            pass

        def _forward(self, method: str, body: bytes | None) -> tuple[int, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(up.hostname, up.port, timeout=600)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                conn.request(method, self.path, body=body, headers=headers)
                r = conn.getresponse()
                return r.status, [(k, v) for k, v in r.getheaders()
                                  if k.lower() not in ("transfer-encoding", "connection", "content-length")], r.read()
            finally:
                conn.close()

        def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            counters.add("passed")
            try:
                self._reply(*self._forward("GET", None))
            except OSError as e:
                self._reply(502, [("Content-Type", "text/plain")], f"upstream: {e}".encode())

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            key = cache_key(self.path.split("?")[0], body)
            entry = cache / key[:2] / f"{key}.json" if key else None
            if entry is not None and entry.exists():
                counters.add("hits")
                self._reply(200, [("Content-Type", "application/json")], entry.read_bytes())
                return
            try:
                status, headers, answer = self._forward("POST", body)
            except OSError as e:
                self._reply(502, [("Content-Type", "text/plain")], f"upstream: {e}".encode())
                return
            if entry is not None and status == 200:
                counters.add("misses")
                entry.parent.mkdir(parents=True, exist_ok=True)
                tmp = entry.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_bytes(answer)
                os.replace(tmp, entry)
            else:
                counters.add("passed")
            self._reply(status, headers, answer)

    return Handler


def pack(cache: Path, archive: Path) -> int:
    """Every cached answer into one gzipped JSON-lines file (sorted: the same cache packs the same),
    written to a temporary name and renamed; returns how many. The study keeps its answers in git
    this way: `runs/` does not outlive a machine, and the answers are what costs hours."""
    import gzip

    entries = sorted(cache.glob("*/*.json"))
    tmp = archive.with_name(archive.name + ".tmp")
    archive.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"key": e.stem, "answer": e.read_text()}) + "\n" for e in entries)
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0, filename="") as f:
        f.write(lines.encode())  # mtime 0, no name: the same answers give the same bytes (a clean git diff)
    os.replace(tmp, archive)
    return len(entries)


def unpack(archive: Path, cache: Path) -> int:
    """The entries of a packed file that the cache lacks; returns how many were added."""
    import gzip

    added = 0
    with gzip.open(archive, "rt") as f:
        for line in f:
            row = json.loads(line)
            entry = cache / row["key"][:2] / f"{row['key']}.json"
            if not entry.exists():
                entry.parent.mkdir(parents=True, exist_ok=True)
                tmp = entry.with_suffix(".unpack.tmp")
                tmp.write_text(row["answer"])
                os.replace(tmp, entry)
                added += 1
    return added


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--upstream", required=True, help="the baseline server's base URL")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cache", required=True, help="folder of cached answers")
    ap.add_argument("--seed", type=Path, help="a packed file (pack()) whose answers the cache starts with")
    args = ap.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    if args.seed is not None and args.seed.exists():
        print(json.dumps({"seeded": unpack(args.seed, cache)}), flush=True)
    counters = Counters()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.upstream, cache, counters))
    server.daemon_threads = True

    def stop(*_) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)  # a terminated proxy still prints its counts
    try:
        server.serve_forever()
    finally:
        print(json.dumps({"hits": counters.hits, "misses": counters.misses, "passed": counters.passed}), flush=True)


if __name__ == "__main__":
    main()
