"""The serving-contract check ("doctor"): refuses a draft SGLang, vLLM or llama.cpp would serve wrong without an error.

Owns `run_doctor` (a draft folder and its target, optionally the launch command, against one engine),
`DoctorReport`, the `fix=True` repair and `expected_aux_layer_ids_from_lineage`. Promises: each silent
failure of CONTRACTS.md a folder or command can show (1-6), and a draft built for another target, is a
named check whose message says what is wrong and how to fix it, one cause per check where causes can be
told apart; what cannot be verified (trained layers unknown, a non-local --model-path) passes as a
warning, never silently; only safetensors are read; `fix=True` never touches the draft: it writes a
corrected copy only when every failing folder check is mechanical, and re-checks the copy.

Layout: core.py (report, target, folder, EngineContract, context, lineage), checks.py (the folder
checks every engine shares), command.py (launch-command helpers), fix.py (the repair), one module per
engine (sglang.py, vllm.py, llamacpp.py: its facts and checks as one EngineContract; llama.cpp's also
checks the converted GGUF) and run.py (the registry and
`run_doctor`). The names below are the public API.
"""

from serving.doctor.core import (
    KNOWN,
    MIDLAYER_KEYS,
    REQUIRED,
    Check,
    DoctorReport,
    Engine,
    EngineContract,
    TargetInfo,
    canonical_key,
    expected_aux_layer_ids_from_lineage,
    load_target_info,
)
from serving.doctor.run import CONTRACTS, ENGINES, run_doctor

__all__ = ["CONTRACTS", "ENGINES", "KNOWN", "MIDLAYER_KEYS", "REQUIRED", "Check", "DoctorReport", "Engine",
           "EngineContract", "TargetInfo", "canonical_key", "expected_aux_layer_ids_from_lineage",
           "load_target_info", "run_doctor"]
