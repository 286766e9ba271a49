"""The serving-contract check ("doctor"): refuses a draft SGLang, vLLM or llama.cpp would serve wrong without an error.

Owns `run_doctor` (a draft folder and its target, optionally the launch command, against one engine),
`DoctorReport`, the `fix=True` repair and `expected_aux_layer_ids_from_lineage`. Promises: each silent
failure of docs/contracts.md a folder or command can show (1-6), and a draft built for another target, is a
named check whose message says what is wrong and how to fix it, one cause per check where causes can be
told apart; what cannot be verified (trained layers unknown, a non-local --model-path) passes as a
warning, never silently; only safetensors are read; `fix=True` never touches the draft: it writes a
corrected copy only when every failing folder check is mechanical, and re-checks the copy.

Layout: core.py (report, target, EngineContract, context, lineage), command.py (launch-command
helpers), fix.py (the repair) and run.py (the registry and `run_doctor`). The folder checks every
engine shares are the serving contract's, serving/contract.py (export's read-back calls the same);
each engine's own facts and checks are its package's doctor.py (serving/sglang, serving/vllm,
serving/llamacpp: one EngineContract each; llama.cpp's also checks the converted GGUF). The names
below are the public API.
"""

from typing import Any

from serving.doctor.core import (
    Check,
    DoctorReport,
    Engine,
    EngineContract,
    TargetInfo,
    expected_aux_layer_ids_from_lineage,
    load_target_info,
)
from serving.draft_folder import KNOWN, MIDLAYER_KEYS, REQUIRED, canonical_key

__all__ = ["CONTRACTS", "ENGINES", "KNOWN", "MIDLAYER_KEYS", "REQUIRED", "Check", "DoctorReport", "Engine",
           "EngineContract", "TargetInfo", "canonical_key", "expected_aux_layer_ids_from_lineage",
           "load_target_info", "run_doctor"]


def __getattr__(name: str) -> Any:
    # run.py imports every engine's package, whose checks import serving/contract.py, which imports
    # core.py from this package: loading run.py here at import time would be a cycle, so its names
    # are loaded on first use.
    if name in ("CONTRACTS", "ENGINES", "run_doctor"):
        from serving.doctor import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
