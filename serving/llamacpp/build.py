"""Portable builds of llama.cpp from the source pinned for this project (the tree llama-cpp-python vendors).

Owns the one list of build flags every llama.cpp build here uses (the Makefile reads it:
`python3 serving/llamacpp/build.py cmake-args`), and building one of llama.cpp's own programs
(`llama-bench`, `llama-server`) from the pinned sdist, cached by the sdist's hash and the flags.
`make install` puts the embedded server there: `python3 serving/llamacpp/build.py install llama-server
.venv/bin` (built once per source hash and flags, then copied). Promises: a build is for any x86-64
CPU with AVX2 unless the caller asks for `native` (only for measuring what portability costs); a
failed build raises `BuildError` with the command and the tail of its output; `installed_binary`
finds the installed program or says how to install it. Standard library only, so it runs before
the venv exists.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# For any x86-64 CPU with AVX2, FMA, F16C and BMI2 (every x86 server CPU since 2013-2015), never
# -march=native: machines of one kind do not share a CPU model, and a native build from one with
# AVX-512 or AMX dies of SIGILL on one without. One variant, not GGML_CPU_ALL_VARIANTS: the
# Python binding loads its libraries directly, not through ggml's backend loader.
PORTABLE_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_BACKEND_DL=OFF",
    "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF",
    "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
)
# Only to measure what portability costs on the machine at hand; never installed.
NATIVE_CMAKE_ARGS = ("-DGGML_NATIVE=ON",)
# A standalone program: static libraries, no network features, nothing but the target itself.
_STANDALONE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON")


class BuildError(RuntimeError):
    """A download or build step failed; the message carries the command and its output's tail."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3_BUILD_CACHE", Path.home() / ".cache" / "eagle3" / "llama-cpp"))


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        code = subprocess.call(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise BuildError(f"`{' '.join(cmd)}` exited with {code}; log {log}, last lines:\n{tail}")


def fetch_sdist(cache_dir: Path | None = None, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The pinned llama-cpp-python sdist (downloaded once from the package index; pip checks its hash)."""
    cache_dir = cache_dir or default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (cache_dir / name).is_file():
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "--no-cache-dir",
              f"llama-cpp-python=={version}", "-d", str(cache_dir)], cache_dir / "download.log")
    return cache_dir / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_tree(sdist: Path, cache_dir: Path) -> tuple[Path, str]:
    """The vendored llama.cpp tree of the sdist, unpacked once per sdist hash; and that hash."""
    digest = _sha256(sdist)
    root = cache_dir / f"src-{digest[:16]}"
    tree = root / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
        (root / ".complete").touch()
    return tree, digest


def build_tool(target: str, cmake_args: tuple[str, ...] = PORTABLE_CMAKE_ARGS, cache_dir: Path | None = None,
               jobs: int | None = None) -> Path:
    """Build llama.cpp's program `target` from the pinned source with `cmake_args`; cached by source hash and flags."""
    if shutil.which("cmake") is None:
        raise BuildError("cmake is not installed (Debian: apt-get install cmake)")
    cache_dir = cache_dir or default_cache_dir()
    tree, digest = source_tree(fetch_sdist(cache_dir), cache_dir)
    flags = hashlib.sha256("\0".join(cmake_args).encode()).hexdigest()[:12]
    build = cache_dir / f"build-{digest[:16]}-{flags}"
    binary = build / "bin" / target
    stamp = build / f".{target}.built"
    if binary.is_file() and stamp.exists():
        return binary
    build.mkdir(parents=True, exist_ok=True)
    log = build / "build.log"
    _run(["cmake", "-S", str(tree), "-B", str(build), *_STANDALONE_ARGS, *cmake_args], log)
    _run(["cmake", "--build", str(build), "--target", target, "-j", str(jobs or os.cpu_count() or 2)], log)
    if not binary.is_file():
        raise BuildError(f"the build finished but {binary} is missing; log {log}")
    stamp.write_text(" ".join(cmake_args) + "\n")
    return binary


def install_tool(target: str, bin_dir: Path, cache_dir: Path | None = None) -> Path:
    """Build `target` (cached) and copy it into `bin_dir` atomically; returns the installed path."""
    built = build_tool(target, cache_dir=cache_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    tmp = bin_dir / f".{target}.tmp"
    shutil.copy2(built, tmp)
    os.replace(tmp, bin_dir / target)
    return bin_dir / target


def installed_binary(target: str = "llama-server") -> Path:
    """The installed llama.cpp program: $EAGLE3_LLAMA_SERVER for llama-server, else the venv's bin/."""
    override = os.environ.get("EAGLE3_LLAMA_SERVER") if target == "llama-server" else None
    path = Path(override) if override else Path(sys.executable).parent / target
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BuildError(f"{target} is not installed at {path}: `make install` builds it from the pinned llama.cpp "
                         f"source (or: python3 serving/llamacpp/build.py install {target} {path.parent})")
    return path


if __name__ == "__main__":
    # `python3 serving/llamacpp/build.py cmake-args | version`: the flags and version, for the Makefile's pip install.
    if sys.argv[1:] == ["cmake-args"]:
        print(" ".join(PORTABLE_CMAKE_ARGS))
    elif sys.argv[1:] == ["version"]:
        print(LLAMA_CPP_PYTHON_VERSION)
    elif sys.argv[1:2] == ["build"] and len(sys.argv) == 3:
        print(build_tool(sys.argv[2]))
    elif sys.argv[1:2] == ["install"] and len(sys.argv) == 4:
        try:
            print(install_tool(sys.argv[2], Path(sys.argv[3])))
        except BuildError as e:
            sys.exit(f"llama.cpp build failed: {e}")
    else:
        sys.exit("usage: python3 serving/llamacpp/build.py cmake-args | version | build TARGET | install TARGET BIN_DIR")
