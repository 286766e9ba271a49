"""Starting and describing inference servers: the embedded llama.cpp server, and the production baselines.

Owns the llama.cpp server's life (start, health wait, stop) and the command lines of the
production baseline servers (SGLang, vLLM, no speculation). Promises: a started llama.cpp server
is healthy (`/v1/models` answers 200) or the start raises `ServerStartError` with the tail of its
log; it is stopped (its whole process group, SIGTERM then SIGKILL) on exit, on error and on
Ctrl-C, so no server outlives the code that started it. A baseline command either validates with
no problems or each problem is one readable line: a "baseline" that speculates, runs eagerly,
runs remote code unasked or spans the wrong GPU count would make every speedup measured
against it wrong.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

Engine = Literal["sglang", "vllm"]
LOG_TAIL_LINES = 40

# Runs the server module in a child that exits when its parent dies: a parent killed with
# SIGKILL runs no cleanup, and a server left behind in its own session would hold the port.
# (PR_SET_PDEATHSIG would fire when the starting *thread* ends, e.g. a worker thread of a pool.)
_WATCH_PARENT = (
    "import os, runpy, sys, threading, time\n"
    "parent = int(sys.argv.pop(1))\n"
    "def watch():\n"
    "    while os.getppid() == parent:\n"
    "        time.sleep(0.5)\n"
    "    os._exit(0)\n"
    "threading.Thread(target=watch, daemon=True).start()\n"
    "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)\n"
)


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message carries the tail of its log."""


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
    """llama-cpp-python's OpenAI-compatible server on one GGUF, as a context manager.

    `with LlamaCppServer(gguf) as server: ... server.base_url ...`. Started in its own session
    (process group): Ctrl-C in a terminal reaches only this process, which stops the server and
    then lets KeyboardInterrupt propagate; and a stop kills everything the server started.
    """

    def __init__(self, gguf: Path, *, host: str = "127.0.0.1", port: int = 0, n_ctx: int = 2048,
                 n_threads: int | None = None, log_path: Path | None = None, startup_timeout_s: float = 120.0,
                 stop_grace_s: float = 10.0, extra_args: Sequence[str] = ()):
        self.gguf = Path(gguf)
        self.host = host
        self.requested_port = port
        self.port = port
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._log_offset = 0  # where this start's output begins in the log

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        """The server's command line (what the log shows); it runs under a watch on this process."""
        return [sys.executable, "-m", "llama_cpp.server", *self._server_args()]

    def _server_args(self) -> list[str]:
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
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, "-c", _WATCH_PARENT, str(os.getpid()), *self._server_args()],
                                         env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        atexit.register(self.stop)  # a server started without `with` still stops at interpreter exit
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise ServerStartError(
                    f"the llama.cpp server on {self.gguf} exited with code {code} before it became healthy; "
                    f"log {self.log_path}, last lines:\n{log_tail(self.log_path, offset=self._log_offset)}")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"the llama.cpp server on {self.gguf} did not answer {self.base_url}/v1/models within "
                    f"{self.startup_timeout_s:.0f} s; log {self.log_path}, last lines:\n"
                    f"{log_tail(self.log_path, offset=self._log_offset)}")
            time.sleep(0.1)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """The server answers GET /v1/models with 200 (it loads the model before it listens)."""
        try:
            return httpx.get(self.base_url + "/v1/models", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

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


# ---- production baselines (no speculation) -------------------------------------------------------

@dataclass(frozen=True)
class BaselineSpec:
    """What a production baseline server runs; one spec builds both the SGLang and the vLLM command."""

    model_path: str
    gpus: int = 8  # tensor-parallel size: the whole model on one node's GPUs
    host: str = "127.0.0.1"
    port: int = 30000
    trust_remote_code: bool = False  # only when the model needs it (Kimi's tokenizer is custom code)
    served_model_name: str | None = None
    context_length: int | None = None
    mem_fraction: float | None = None  # SGLang --mem-fraction-static / vLLM --gpu-memory-utilization
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def kimi_k25_baseline(model_path: str = "moonshotai/Kimi-K2.5", **overrides) -> BaselineSpec:
    """Kimi-K2.5 on one 8-GPU node, as its SGLang and vLLM guides launch it (TP-8, kimi_k2 parsers)."""
    values = dict(model_path=model_path, gpus=8, trust_remote_code=True, tool_call_parser="kimi_k2",
                  reasoning_parser="kimi_k2")
    return BaselineSpec(**{**values, **overrides})


def sglang_baseline_command(spec: BaselineSpec, python: str = "python3") -> list[str]:
    """`python -m sglang.launch_server ...` for the baseline: tensor parallel, CUDA graphs on, no speculation."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", spec.model_path, "--tp", str(spec.gpus),
           "--host", spec.host, "--port", str(spec.port)]
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    if spec.served_model_name:
        cmd += ["--served-model-name", spec.served_model_name]
    if spec.context_length:
        cmd += ["--context-length", str(spec.context_length)]
    if spec.mem_fraction is not None:
        cmd += ["--mem-fraction-static", str(spec.mem_fraction)]
    if spec.tool_call_parser:
        cmd += ["--tool-call-parser", spec.tool_call_parser]
    if spec.reasoning_parser:
        cmd += ["--reasoning-parser", spec.reasoning_parser]
    return cmd + list(spec.extra_args)


def vllm_baseline_command(spec: BaselineSpec, vllm: str = "vllm") -> list[str]:
    """`vllm serve MODEL ...` for the baseline: tensor parallel, CUDA graphs on, no speculation."""
    cmd = [vllm, "serve", spec.model_path, "--tensor-parallel-size", str(spec.gpus), "--host", spec.host,
           "--port", str(spec.port)]
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    if spec.served_model_name:
        cmd += ["--served-model-name", spec.served_model_name]
    if spec.context_length:
        cmd += ["--max-model-len", str(spec.context_length)]
    if spec.mem_fraction is not None:
        cmd += ["--gpu-memory-utilization", str(spec.mem_fraction)]
    if spec.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", spec.tool_call_parser]
    if spec.reasoning_parser:
        cmd += ["--reasoning-parser", spec.reasoning_parser]
    return cmd + list(spec.extra_args)


# Flags that turn speculation on without the `--speculative` prefix (older vLLM releases).
_SPECULATIVE_UNPREFIXED = {"--num-speculative-tokens", "--ngram-prompt-lookup-max", "--ngram-prompt-lookup-min"}
_TP_FLAGS: dict[str, tuple[str, ...]] = {
    "sglang": ("--tp", "--tp-size", "--tensor-parallel-size"),
    "vllm": ("--tensor-parallel-size", "-tp"),
}
_MODEL_FLAGS: dict[str, tuple[str, ...]] = {"sglang": ("--model-path", "--model"), "vllm": ("--model",)}
_EAGER_FLAGS: dict[str, str] = {"sglang": "--disable-cuda-graph", "vllm": "--enforce-eager"}


def _flag_name(token: str) -> str:
    """`--Some_flag=value` -> `--some-flag`: both engines accept `_` for `-` in flag names."""
    name = token.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def _flag_values(argv: Sequence[str], names: Sequence[str]) -> list[str | None]:
    """Every value given to any of `names` (`--flag value` or `--flag=value`; None when no value follows)."""
    values: list[str | None] = []
    for i, token in enumerate(argv):
        if not token.startswith("-") or _flag_name(token) not in names:
            continue
        if "=" in token:
            values.append(token.split("=", 1)[1])
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            values.append(argv[i + 1])
        else:
            values.append(None)
    return values


def _launches(argv: Sequence[str], engine: Engine) -> tuple[bool, int]:
    """Whether argv starts the engine's server, and where its own arguments begin."""
    for i, token in enumerate(argv):
        if engine == "sglang":
            if token == "sglang.launch_server" and i > 0 and argv[i - 1] == "-m":
                return True, i + 1
            if Path(token).name == "sglang" and i + 1 < len(argv) and argv[i + 1] == "serve":
                return True, i + 2
        else:
            if Path(token).name == "vllm" and i + 1 < len(argv) and argv[i + 1] == "serve":
                return True, i + 2
            if token == "vllm.entrypoints.openai.api_server" and i > 0 and argv[i - 1] == "-m":
                return True, i + 1
    return False, len(argv)


def validate_baseline_command(argv: Sequence[str], engine: Engine, *, gpus: int = 8,
                              trust_remote_code: bool = False) -> list[str]:
    """Problems that make `argv` not a fair production baseline for `engine`, one readable line each.

    `gpus` is the GPU count the baseline is asked to span (tensor parallel); `trust_remote_code`
    whether running the model's own code was asked for. An empty list means the command is fine.
    """
    if engine not in _TP_FLAGS:
        return [f"unknown engine {engine!r}; expected 'sglang' or 'vllm'"]
    problems: list[str] = []
    ok, start = _launches(argv, engine)
    if not ok:
        expected = "python -m sglang.launch_server" if engine == "sglang" else "vllm serve MODEL"
        problems.append(f"the command does not start {engine} (expected `{expected} ...`)")
    args = list(argv[start:])

    speculative = sorted({_flag_name(t) for t in args if t.startswith("--") and (
        _flag_name(t).startswith("--speculative") or _flag_name(t) in _SPECULATIVE_UNPREFIXED)})
    if speculative:
        problems.append(f"{', '.join(speculative)}: a baseline must not speculate; with speculation this is no baseline")

    models = [v for v in _flag_values(args, _MODEL_FLAGS[engine]) if v]
    if engine == "vllm" and args and not args[0].startswith("-") and ok and argv[start - 1] == "serve":
        models.insert(0, args[0])  # `vllm serve MODEL`: the model is the first positional argument
    if not models:
        flag = "--model-path" if engine == "sglang" else "the MODEL argument of `vllm serve` (or --model)"
        problems.append(f"no model path: give {flag}")

    tps = _flag_values(args, _TP_FLAGS[engine])
    if not tps:
        problems.append(f"no tensor-parallel size: the server would use 1 GPU, but the baseline is asked to span {gpus} "
                        f"(add {_TP_FLAGS[engine][0]} {gpus})")
    for tp in tps:
        if tp is None or not tp.isdigit():
            problems.append(f"tensor-parallel size {tp!r} is not a whole number")
        elif int(tp) != gpus:
            problems.append(f"tensor-parallel size {tp} does not match the {gpus} GPU(s) the baseline is asked to span")
    if len(tps) > 1:
        problems.append(f"the tensor-parallel size is given {len(tps)} times; give it once")

    if not trust_remote_code and any(_flag_name(t) == "--trust-remote-code" for t in args):
        problems.append("--trust-remote-code is set but running the model's own code was not asked for")

    eager = _EAGER_FLAGS[engine]
    if any(_flag_name(t) == eager for t in args):
        problems.append(f"{eager}: the baseline must run as production does (CUDA graphs on), "
                        "or every speedup measured against it is inflated")
    if any(_flag_name(t) == "--config" for t in args):
        problems.append("--config: settings inside a config file escape this check; pass them as flags")
    return problems
