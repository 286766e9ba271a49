"""A server process this code starts and owns: spawn under a watcher, health wait, watch, stop.

Owns what every managed server shares (llama.cpp's `llama-server` in `serving.llamacpp.server`, vLLM in
`serving.vllm.extract_server`): its process group, port choice, log file, health wait and stop. Subclasses
say only what differs: the command line, the health path, the environment and what to check once
it answers. Promises: a started server is healthy or the start raises `ServerStartError` with how it
exited (a signal by name) and the tail of its log; `guard` stops the code using it within a poll
interval of its death with `ServerDied` (same details); it is stopped (its whole process group,
SIGTERM then SIGKILL) on exit, on error and on Ctrl-C, and when our process dies, even of SIGKILL.
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
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

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

class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message carries the tail of its log."""


class ServerDied(RuntimeError):
    """The server exited while in use; the message says how (signal or code) and carries its log tail."""


# What a user should do when a server dies of a signal that points at the build, not the input.
SIGNAL_HINTS: dict[signal.Signals, str] = {
    signal.SIGILL: "an instruction this CPU cannot run: the server was compiled for another CPU",
    signal.SIGBUS: "a bus error: often a GGUF file truncated or changed while mapped",
    signal.SIGSEGV: "a crash inside the server",
    signal.SIGKILL: "killed from outside (the kernel's out-of-memory killer, or a person)",
}


def describe_exit(returncode: int, hints: dict[signal.Signals, str] | None = None) -> str:
    """`exited with code 3`, or `was killed by signal SIGILL (4): <what it means>` (`hints` by signal)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"was killed by signal {-returncode}"
    hint = (SIGNAL_HINTS if hints is None else hints).get(sig)
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


class ManagedServer:
    """A server process as a context manager: `with Server(...) as s: ... s.base_url ...`.

    Started in its own session (process group): Ctrl-C in a terminal reaches only this process,
    which stops the server and then lets KeyboardInterrupt propagate.
    """

    health_path = "/health"
    signal_hints: dict[signal.Signals, str] | None = None  # None: SIGNAL_HINTS

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, log_path: Path | None = None,
                 startup_timeout_s: float = 120.0, stop_grace_s: float = 10.0, log_prefix: str = "server-"):
        self.host = host
        self.requested_port = port
        self.port = port
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_prefix = log_prefix
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._log_offset = 0  # where this start's output begins in the log

    # ------------------------------------------------------------- what a subclass says
    def describe(self) -> str:
        """Names the server in messages, e.g. `the llama.cpp server on model.gguf`."""
        return "the server"

    def command(self) -> list[str]:
        """The server's command line (what the log shows); it runs under a watch on this process."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        # Servers read HOST and PORT from the environment over their flags.
        return {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT")}

    def check_before_start(self) -> None:
        """Raise before any process is spawned when the server cannot start (a missing file)."""
        self.command()

    def after_start(self) -> None:
        """Checks once the server answers its health path; call `stop()` before raising."""

    # ------------------------------------------------------------- the shared life
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()  # returns None: any exception, KeyboardInterrupt included, propagates after the stop

    def log_tail(self) -> str:
        return log_tail(self.log_path, offset=self._log_offset) if self.log_path is not None else "(no log)"

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError(f"this server is already started (pid {self.proc.pid})")
        self.check_before_start()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
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
                    if attempt + 1 < attempts and "address already in use" in self.log_tail().lower():
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
        command = self.command()  # with the port of this attempt
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, "-c", _WATCH_PARENT, str(os.getpid()), *command],
                                         env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.stop)  # a server started without `with` still stops at interpreter exit
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise ServerStartError(
                    f"{self.describe()} {describe_exit(code, self.signal_hints)}, before it became healthy; "
                    f"log {self.log_path}, last lines:\n{self.log_tail()}")
            if self.healthy():
                self.after_start()
                return
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"{self.describe()} did not answer {self.base_url}{self.health_path} within "
                    f"{self.startup_timeout_s:.0f} s; log {self.log_path}, last lines:\n{self.log_tail()}")
            time.sleep(0.1)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """The server answers its health check with 200 (the model is loaded)."""
        try:
            return httpx.get(self.base_url + self.health_path, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def exit_code(self) -> int | None:
        """The server's exit status if it has exited (reaped: no zombie is left), else None."""
        return self.proc.poll() if self.proc is not None else None

    def died_error(self, code: int) -> ServerDied:
        return ServerDied(
            f"{self.describe()} (pid {self.pid}, {self.base_url}) {describe_exit(code, self.signal_hints)}, while in "
            f"use; log {self.log_path}, last lines:\n{self.log_tail()}")

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
