"""The install step's proof that the embedded server runs on this machine: `eagle3 check-install`.

Two checks, each one named line in the report:
- portable: the llama.cpp libraries that llama-cpp-python installed, and the `llama-server` program
  the install built, contain no AVX-512 or AMX instructions (ZMM, opmask or tile registers in their disassembly). A library built with
  `-march=native` on a newer CPU has them and dies of SIGILL on an older CPU of the same machine
  kind, so this is caught on the machine that built it, not on the next one.
- smoke: the embedded server (llama-server) starts on the SmolLM2 GGUF and completes one short greedy request.
  A failure says how the server ended (a signal by name, with what it means) and its log tail.
Promises: `check_install` raises `InstallCheckFailed` with every failed check's reason, or returns
the report; it leaves no server running.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from serving.llamacpp.server import LlamaCppServer, ServerDied, ServerStartError
from serving.llamacpp.build import BuildError, installed_binary

LLAMA_CPP_DIST = "llama-cpp-python"
# Registers only AVX-512 (zmm, opmask k1-k7) or AMX (tmm) code can name, as objdump prints them.
_NON_PORTABLE = re.compile(r"%(zmm\d+|k[1-7]\b|tmm\d)")


class InstallCheckFailed(RuntimeError):
    """The install cannot run the embedded server here; the message says why and what to do."""


@dataclass
class CheckReport:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def ok(self, text: str) -> None:
        self.lines.append(f"ok    {text}")

    def fail(self, text: str) -> None:
        self.lines.append(f"FAIL  {text}")
        self.failures.append(text)


def llama_cpp_libraries() -> list[Path]:
    """The shared libraries installed with llama-cpp-python (found through its metadata, not an import)."""
    try:
        dist = importlib.metadata.distribution(LLAMA_CPP_DIST)
    except importlib.metadata.PackageNotFoundError:
        return []
    return sorted(Path(dist.locate_file(f)) for f in (dist.files or [])
                  if f.name.endswith(".so") or ".so." in f.name)


def non_portable_instructions(library: Path, objdump: str = "objdump") -> int:
    """How many instructions of `library` use AVX-512 or AMX registers (0 for a portable build)."""
    out = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                         check=True).stdout
    return sum(1 for line in out.splitlines() if _NON_PORTABLE.search(line))


def check_portable(report: CheckReport, libraries: list[Path] | None = None) -> None:
    if libraries is None:
        libraries = llama_cpp_libraries()
        if not libraries:
            report.fail(f"portable: no shared libraries of `{LLAMA_CPP_DIST}` are installed (`make install` builds them)")
            return
        try:
            libraries.append(installed_binary("llama-server"))
        except BuildError as e:
            report.fail(f"portable: {e}")
            return
    objdump = shutil.which("objdump")
    if objdump is None:
        report.ok(f"portable: not checked, objdump (binutils) is not installed ({len(libraries)} libraries)")
        return
    offenders: dict[str, int] = {}
    for lib in libraries:
        try:
            if n := non_portable_instructions(lib, objdump):
                offenders[lib.name] = n
        except subprocess.CalledProcessError as e:
            report.fail(f"portable: objdump cannot read {lib} (not a program or library built here?): "
                        f"{(e.stderr or '').strip()[:200]}")
            return
    if offenders:
        listed = ", ".join(f"{name} ({n} instructions)" for name, n in sorted(offenders.items()))
        report.fail(f"portable: AVX-512/AMX code in {listed}: built for one CPU (-march=native or a cached wheel), "
                    "it dies of SIGILL on others. Rebuild: `rm .venv/.llama-cpp-build && make install`")
    else:
        programs = [lib for lib in libraries if ".so" not in lib.name]
        what = f"{len(libraries) - len(programs)} llama.cpp libraries" + "".join(f" and {p.name}" for p in programs)
        report.ok(f"portable: no AVX-512/AMX instructions in {what}")


def check_server(report: CheckReport, gguf: Path, log_path: Path | None = None, max_tokens: int = 8,
                 timeout_s: float = 120.0) -> None:
    """Start the embedded server, complete one greedy request, stop it."""
    server = LlamaCppServer(gguf, n_ctx=512, log_path=log_path, startup_timeout_s=timeout_s)
    payload = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens,
               "temperature": 0.0, "repeat_penalty": 1.0}

    async def complete() -> dict:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.post(server.base_url + "/v1/chat/completions", json=payload)
            r.raise_for_status()
            return r.json()

    started = time.monotonic()
    try:
        with server:
            body = asyncio.run(server.guard(complete()))
    except (ServerStartError, ServerDied, BuildError) as e:
        report.fail(f"smoke: {e}")
        return
    except httpx.HTTPError as e:
        report.fail(f"smoke: the embedded server answered the greedy request with an error: {e!r}; log {server.log_path}")
        return
    text = (body.get("choices") or [{}])[0].get("message", {}).get("content") or ""
    tokens = (body.get("usage") or {}).get("completion_tokens")
    report.ok(f"smoke: the embedded server on {gguf.name} answered a greedy request "
              f"({tokens} tokens, {time.monotonic() - started:.1f} s with start-up): {text.strip()[:60]!r}")


def check_install(gguf: Path, log_path: Path | None = None) -> CheckReport:
    report = CheckReport()
    check_portable(report)
    check_server(report, gguf, log_path)
    if report.failures:
        raise InstallCheckFailed("\n".join(report.lines))
    return report
