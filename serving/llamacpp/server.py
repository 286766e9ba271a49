"""The embedded llama.cpp server: `llama-server`'s command line and its start-up checks.

Owns the `llama-server` command line (built from the pinned llama.cpp source by `make install`):
parallel slots, threads, context, and speculative decoding (an EAGLE-3 draft GGUF or llama.cpp's
n-gram drafting). llama-cpp-python's older Python server stays selectable (`engine=`) only so
benchmarks can compare the two. Its life (process group, health wait, guard, stop) is
`serving.process.ManagedServer`'s. Promises, beyond that class's: a server asked to speculate
really does (llama.cpp otherwise logs an error and serves without it), or the start fails saying
so; a SIGILL names the cause (a llama.cpp build for another CPU) and the fix.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

# Re-exported: callers import the server's errors and port helpers from here.
from serving import process
from serving.process import SIGNAL_HINTS, ManagedServer, ServerDied, ServerStartError, free_port, log_tail, port_free  # noqa: F401

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


# llama.cpp's own advice for a signal that points at its build, not at the input.
LLAMA_SIGNAL_HINTS = {**SIGNAL_HINTS, signal.SIGILL:
                      "an instruction this CPU cannot run: the llama.cpp library was compiled for another CPU "
                      "(-march=native elsewhere, or a wheel cached from such a build). Rebuild it portable: "
                      "`rm .venv/.llama-cpp-build && make install` (see README, 'The server dies of SIGILL')"}


def describe_exit(returncode: int) -> str:
    """How a llama.cpp server ended, with llama.cpp's advice for a signal (`process.describe_exit`)."""
    return process.describe_exit(returncode, LLAMA_SIGNAL_HINTS)


class LlamaCppServer(ManagedServer):
    """llama.cpp's `llama-server` on one GGUF (optionally speculating), as a context manager.

    `with LlamaCppServer(gguf, parallel=2) as server: ... server.base_url ...`. `parallel` slots
    decode together (continuous batching); each gets `n_ctx` tokens of context. Its life (process
    group, health wait, guard, stop) is `ManagedServer`'s.
    """

    signal_hints = LLAMA_SIGNAL_HINTS

    def __init__(self, gguf: Path, *, host: str = "127.0.0.1", port: int = 0, n_ctx: int = 2048,
                 n_threads: int | None = None, parallel: int = 1, speculation: Speculation | None = None,
                 engine: ServerEngine = "llama-server", log_path: Path | None = None, startup_timeout_s: float = 120.0,
                 stop_grace_s: float = 10.0, extra_args: Sequence[str] = ()):
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        if engine == "llama-cpp-python" and (parallel != 1 or speculation is not None):
            raise ValueError("llama-cpp-python's server has one slot and no speculation here; use engine='llama-server'")
        super().__init__(host=host, port=port, log_path=log_path, startup_timeout_s=startup_timeout_s,
                         stop_grace_s=stop_grace_s, log_prefix="llama-cpp-server-")
        self.gguf = Path(gguf)
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.parallel = parallel
        self.speculation = speculation
        self.engine = engine
        self.extra_args = list(extra_args)
        self.build_info: str | None = None  # llama.cpp's build, e.g. "b1-0c1e570" (from /props)

    def describe(self) -> str:
        return f"the llama.cpp server on {self.gguf}"

    def command(self) -> list[str]:
        if self.engine == "llama-cpp-python":
            return [sys.executable, "-m", "llama_cpp.server", *self._python_server_args()]
        from serving.llamacpp.build import installed_binary

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

    def check_before_start(self) -> None:
        if not self.gguf.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.gguf}")
        if self.speculation is not None and self.speculation.draft_gguf is not None \
                and not Path(self.speculation.draft_gguf).is_file():
            raise FileNotFoundError(f"no draft GGUF file at {self.speculation.draft_gguf}")
        self.command()  # raises here, before any process, when llama-server is not installed

    @property
    def health_path(self) -> str:  # type: ignore[override]
        # llama-server listens while it loads and answers /health 503 until the model is ready.
        return "/health" if self.engine == "llama-server" else "/v1/models"

    def after_start(self) -> None:
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
                f"log {self.log_path}, last lines:\n{self.log_tail()}")
