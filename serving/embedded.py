"""The embedded llama.cpp server's life: start, health wait, watch, stop.

Owns the `llama-server` command line (built from the pinned llama.cpp source by `make install`):
parallel slots, threads, context, and speculative decoding (an EAGLE-3 draft GGUF or llama.cpp's
n-gram drafting). llama-cpp-python's older Python server stays selectable (`engine=`) only so
benchmarks can compare the two. Promises: a started server is healthy (`/health` answers 200) or
the start raises `ServerStartError` with how it exited (a signal by name: SIGILL means a build for
another CPU) and the tail of its log; a server asked to speculate really does (llama.cpp otherwise
logs an error and serves without it), or the start fails saying so; while code uses it, `guard`
stops that code within a poll interval of the server's death with `ServerDied` (same details), so
no request is sent to a dead server; it is stopped (its whole process group, SIGTERM then SIGKILL)
on exit, on error and on Ctrl-C, so no server outlives the code that started it.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import httpx

LOG_TAIL_LINES = 40
T = TypeVar("T")

# Runs the server under a small watcher that takes its process group down when our process dies:
# a parent killed with SIGKILL runs no cleanup, and a server left behind in its own session would
# hold the port. (PR_SET_PDEATHSIG would fire when the starting *thread* ends, e.g. a worker
# thread of a pool.) The watcher ends the way the server ended, signal included, so a SIGILL
# still reads as SIGILL to `describe_exit`. A SIGTERM to the group waits for the server to end, so
# `stop()` returns once the server has closed its port, not when the watcher alone has died.
_WATCH_PARENT = (
    "import os, signal, subprocess, sys, threading, time\n"
    "parent = int(sys.argv[1])\n"
    "child = subprocess.Popen(sys.argv[2:])\n"
    "signal.signal(signal.SIGTERM, lambda *_: child.terminate())\n"
    "def watch():\n"
    "    while os.getppid() == parent:\n"
    "        time.sleep(0.5)\n"
    "    os.killpg(0, signal.SIGKILL)\n"
    "threading.Thread(target=watch, daemon=True).start()\n"
    "code = child.wait()\n"
    "if code < 0:\n"
    "    if -code not in (signal.SIGKILL, signal.SIGSTOP):\n"
    "        signal.signal(-code, signal.SIG_DFL)\n"
    "    os.kill(os.getpid(), -code)\n"
    "sys.exit(code)\n"
)

ServerEngine = Literal["llama-server", "llama-cpp-python"]
SpecType = Literal["draft-eagle3", "ngram-simple", "ngram-mod"]


@dataclass(frozen=True)
class Speculation:
    """llama-server's speculative decoding: an EAGLE-3 draft GGUF, or n-gram drafting from the context."""

    spec_type: SpecType
    draft_gguf: Path | None = None  # required for draft-eagle3
    n_max: int = 3  # draft tokens per verification step (chain depth k)
    p_min: float = 0.0  # 0: never cut a chain short on the draft's confidence, as our offline evaluator

    def __post_init__(self) -> None:
        if (self.spec_type == "draft-eagle3") != (self.draft_gguf is not None):
            raise ValueError(f"spec type {self.spec_type} {'needs' if self.draft_gguf is None else 'takes no'} "
                             "draft GGUF")
        if self.n_max < 1:
            raise ValueError(f"n_max must be >= 1, got {self.n_max}")

    def args(self) -> list[str]:
        """The flags. The n-gram types ignore `--spec-draft-n-max` and read their own draft length
        (ngram-simple drafts 48 tokens and ngram-mod 48-64 unless told); ngram-simple drafts nothing
        when its draft length is below its lookup length (12 by default; common/ngram-map.cpp:
        `copy_max < n_draft_min`), so at K < 12 it looks up K tokens. ngram-mod: at most K, at least 1."""
        args = ["--spec-type", self.spec_type, "--spec-draft-n-max", str(self.n_max),
                "--spec-draft-p-min", str(self.p_min)]
        if self.draft_gguf is not None:
            args = ["-md", str(self.draft_gguf)] + args
        if self.spec_type == "ngram-simple":
            args += ["--spec-ngram-simple-size-m", str(self.n_max), "--spec-ngram-simple-size-n", str(min(12, self.n_max))]
        elif self.spec_type == "ngram-mod":
            args += ["--spec-ngram-mod-n-max", str(self.n_max), "--spec-ngram-mod-n-min", "1"]
        return args

    @property
    def label(self) -> str:
        return f"eagle3-k{self.n_max}" if self.spec_type == "draft-eagle3" else f"{self.spec_type}-k{self.n_max}"


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message carries the tail of its log."""


class ServerDied(RuntimeError):
    """The server exited while in use; the message says how (signal or code) and carries its log tail."""


# What a user should do when the server dies of a signal that points at the build, not the input.
_SIGNAL_HINTS = {
    signal.SIGILL: "an instruction this CPU cannot run: the llama.cpp library was compiled for another CPU "
                   "(-march=native elsewhere, or a wheel cached from such a build). Rebuild it portable: "
                   "`rm .venv/.llama-cpp-build && make install` (see README, 'The server dies of SIGILL')",
    signal.SIGBUS: "a bus error: often a GGUF file truncated or changed while mapped",
    signal.SIGSEGV: "a crash inside the server",
    signal.SIGKILL: "killed from outside (the kernel's out-of-memory killer, or a person)",
}


def describe_exit(returncode: int) -> str:
    """`exited with code 3`, or `was killed by signal SIGILL (4): <what it means>`."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"was killed by signal {-returncode}"
    hint = _SIGNAL_HINTS.get(sig)
    return f"was killed by signal {sig.name} ({sig.value})" + (f": {hint}" if hint else "")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the kernel's pick); a racing process may still take it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Nobody listens on host:port (bound as uvicorn binds: SO_REUSEADDR, so TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def log_tail(path: Path, lines: int = LOG_TAIL_LINES, offset: int = 0) -> str:
    """The last `lines` lines of the log written after byte `offset` (a log may hold earlier runs)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


class LlamaCppServer:
    """llama.cpp's `llama-server` on one GGUF (optionally speculating), as a context manager.

    `with LlamaCppServer(gguf, parallel=2) as server: ... server.base_url ...`. `parallel` slots
    decode together (continuous batching); each gets `n_ctx` tokens of context. Started in its
    own session (process group): Ctrl-C in a terminal reaches only this process, which stops the
    server and then lets KeyboardInterrupt propagate; and a stop kills everything it started.
    """

    def __init__(self, gguf: Path, *, host: str = "127.0.0.1", port: int = 0, n_ctx: int = 2048,
                 n_threads: int | None = None, parallel: int = 1, speculation: Speculation | None = None,
                 engine: ServerEngine = "llama-server", log_path: Path | None = None, startup_timeout_s: float = 120.0,
                 stop_grace_s: float = 10.0, extra_args: Sequence[str] = ()):
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        if engine == "llama-cpp-python" and (parallel != 1 or speculation is not None):
            raise ValueError("llama-cpp-python's server has one slot and no speculation here; use engine='llama-server'")
        self.gguf = Path(gguf)
        self.host = host
        self.requested_port = port
        self.port = port
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.parallel = parallel
        self.speculation = speculation
        self.engine = engine
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.build_info: str | None = None  # llama.cpp's build, e.g. "b1-0c1e570" (from /props)
        self._log_offset = 0  # where this start's output begins in the log

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        """The server's command line (what the log shows); it runs under a watch on this process."""
        if self.engine == "llama-cpp-python":
            return [sys.executable, "-m", "llama_cpp.server", *self._python_server_args()]
        from serving.llama_build import installed_binary

        return [str(installed_binary("llama-server")), *self._server_args()]

    def _server_args(self) -> list[str]:
        # -c is the whole cache, split evenly between the slots.
        args = ["-m", str(self.gguf), "--host", self.host, "--port", str(self.port), "-c", str(self.n_ctx * self.parallel),
                "-np", str(self.parallel), "--no-webui", "--metrics"]
        if self.n_threads is not None:
            args += ["-t", str(self.n_threads), "-tb", str(self.n_threads)]
        if self.speculation is not None:
            args += self.speculation.args()
        return args + self.extra_args

    def _python_server_args(self) -> list[str]:
        args = ["--model", str(self.gguf), "--host", self.host, "--port", str(self.port), "--n_ctx", str(self.n_ctx)]
        if self.n_threads is not None:
            # n_threads is used while generating, n_threads_batch while reading the prompt.
            args += ["--n_threads", str(self.n_threads), "--n_threads_batch", str(self.n_threads)]
        return args + self.extra_args

    def __enter__(self) -> LlamaCppServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()  # returns None: any exception, KeyboardInterrupt included, propagates after the stop

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError(f"this server is already started (pid {self.proc.pid})")
        if not self.gguf.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.gguf}")
        if self.speculation is not None and self.speculation.draft_gguf is not None \
                and not Path(self.speculation.draft_gguf).is_file():
            raise FileNotFoundError(f"no draft GGUF file at {self.speculation.draft_gguf}")
        self.command()  # raises here, before any process, when llama-server is not installed
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-cpp-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        # A port picked by the kernel can be taken by someone else before the server binds it:
        # then try another one, a few times, only when we picked the port ourselves.
        attempts = 3 if self.requested_port == 0 else 1
        try:
            for attempt in range(attempts):
                self.port = free_port(self.host) if self.requested_port == 0 else self.requested_port
                try:
                    self._spawn_and_wait()
                    break
                except ServerStartError:
                    tail = log_tail(self.log_path, offset=self._log_offset).lower()
                    if attempt + 1 < attempts and "address already in use" in tail:
                        continue
                    raise
        except BaseException:  # includes KeyboardInterrupt during the wait: no server is left behind
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def _spawn_and_wait(self) -> None:
        if not port_free(self.host, self.port):
            # Checked first: another server already on the port would answer our health probe.
            raise ServerStartError(f"{self.host}:{self.port} is already in use by another process; "
                                   "stop it or choose another port (port 0 picks a free one)")
        # The server reads HOST and PORT from the environment over its flags.
        env = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT")}
        command = self.command()  # with the port of this attempt
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, "-c", _WATCH_PARENT, str(os.getpid()), *command],
                                         env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        atexit.register(self.stop)  # a server started without `with` still stops at interpreter exit
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise ServerStartError(
                    f"the llama.cpp server on {self.gguf} {describe_exit(code)}, before it became healthy; "
                    f"log {self.log_path}, last lines:\n{log_tail(self.log_path, offset=self._log_offset)}")
            if self.healthy():
                self._after_start()
                return
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"the llama.cpp server on {self.gguf} did not answer {self.base_url}{self._health_path} within "
                    f"{self.startup_timeout_s:.0f} s; log {self.log_path}, last lines:\n"
                    f"{log_tail(self.log_path, offset=self._log_offset)}")
            time.sleep(0.1)

    @property
    def _health_path(self) -> str:
        # llama-server listens while it loads and answers /health 503 until the model is ready.
        return "/health" if self.engine == "llama-server" else "/v1/models"

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """The server answers its health check with 200 (the model is loaded)."""
        try:
            return httpx.get(self.base_url + self._health_path, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _after_start(self) -> None:
        """Read the build; a server asked to speculate must be speculating (llama.cpp falls back silently)."""
        if self.engine != "llama-server":
            return
        try:
            self.build_info = httpx.get(self.base_url + "/props", timeout=10).json().get("build_info")
            slots = httpx.get(self.base_url + "/slots", timeout=10).json() if self.speculation is not None else []
        except (httpx.HTTPError, ValueError) as e:
            self.stop()
            raise ServerStartError(f"the llama.cpp server on {self.gguf} is up but /props or /slots failed: {e!r}; "
                                   f"log {self.log_path}") from None
        if self.speculation is not None and not all(slot.get("speculative") for slot in slots):
            self.stop()
            raise ServerStartError(
                f"llama-server started without speculative decoding ({self.speculation.spec_type}, draft "
                f"{self.speculation.draft_gguf}): it could not set it up and serves without it; "
                f"log {self.log_path}, last lines:\n{log_tail(self.log_path, offset=self._log_offset)}")

    def exit_code(self) -> int | None:
        """The server's exit status if it has exited (reaped: no zombie is left), else None."""
        return self.proc.poll() if self.proc is not None else None

    def died_error(self, code: int) -> ServerDied:
        return ServerDied(
            f"the llama.cpp server on {self.gguf} (pid {self.pid}, {self.base_url}) {describe_exit(code)}, while in use; "
            f"log {self.log_path}, last lines:\n{log_tail(self.log_path, offset=self._log_offset)}")

    async def guard(self, work: Awaitable[T], poll_s: float = 0.5) -> T:
        """Await `work` while watching the server; if the server exits first, cancel `work` and
        raise ServerDied. A dead server otherwise looks like a slow outage: every request retries,
        backs off and waits for probes before anything says why."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    return task.result()
                code = self.exit_code()
                if code is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    raise self.died_error(code)
        finally:
            if not task.done():  # cancelled from outside (Ctrl-C): take the work down too
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after `stop_grace_s`; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the session leader's pid is its group id
            proc.wait(timeout=self.stop_grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        finally:  # also when a second Ctrl-C interrupts the grace period
            try:  # the whole group: nothing that ignored SIGTERM may outlive the server
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
