"""SGLang's command lines: the production baseline and speculative (EAGLE-3) servers on a draft folder.

Owns `sglang_baseline_command`, the speculative settings SGLang runs as given
(`sglang_speculative_problems`, `eagle_tree_candidates`), the algorithm a draft calls for
(`sglang_draft_algorithm`), `sglang_speculative_command` and `speculative_sweep`. Promises:
speculative commands are built from the draft checkpoint itself (EAGLE3 for an EAGLE-3 draft, never
EAGLE: docs/contracts.md, failure 1) and only for settings SGLang runs as given; the baseline
speculates never (serving/launch.py checks it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.draft_folder import CONFIG_FILE, SGLANG_ARCHITECTURE, SPECULATORS_ARCHITECTURE
from serving.launch import BaselineSpec, baseline_options


def sglang_baseline_command(spec: BaselineSpec, python: str = "python3") -> list[str]:
    """`python -m sglang.launch_server ...` for the baseline: tensor parallel, CUDA graphs on, no speculation."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", spec.model_path, "--tp", str(spec.gpus),
           "--host", spec.host, "--port", str(spec.port)]
    return cmd + baseline_options(spec, context_flag="--context-length", mem_flag="--mem-fraction-static",
                                  tool_flags=("--tool-call-parser",))


# ---- speculative (EAGLE-3) SGLang servers --------------------------------------------------------
# Facts from SGLang's source (python/sglang/srt/server_args.py `_handle_speculative_decoding` and
# the EAGLE tree builder `build_tree_kernel_efficient_preprocess`):
# - with --speculative-eagle-topk 1, num_draft_tokens != num_steps + 1 is rewritten to num_steps + 1
#   with only a log warning: the server runs another setting than the one asked for;
# - the verify tree is the root plus the best num_draft_tokens - 1 of topk + (num_steps - 1) * topk^2
#   candidates (torch.topk over them), so more draft tokens than that fails at the first decode;
# - topk > 1 with --page-size > 1 is refused unless the attention backend is flashinfer;
# - with none of the three flags SGLang picks its own (e.g. 5/4/8 for Llama targets), and with only
#   some of them it fails an assertion: either way not the setting a benchmark means to measure.

SGLANG_EAGLE3_ALGORITHM = "EAGLE3"


def eagle_tree_candidates(num_steps: int, eagle_topk: int) -> int:
    """Draft tokens SGLang's EAGLE tree chooses from (besides the root): topk, then topk^2 per later step."""
    return eagle_topk + (num_steps - 1) * eagle_topk * eagle_topk


def sglang_speculative_problems(num_steps: object, eagle_topk: object, num_draft_tokens: object, *,
                                page_size: int | None = None, attention_backend: str | None = None) -> list[str]:
    """Why SGLang would not run (num_steps, eagle_topk, num_draft_tokens) as given; empty when it would."""
    values = {"--speculative-num-steps": num_steps, "--speculative-eagle-topk": eagle_topk,
              "--speculative-num-draft-tokens": num_draft_tokens}
    missing = [flag for flag, v in values.items() if v is None]
    if missing:
        return [(f"{', '.join(missing)} not given: SGLang then picks its own values (all three missing) or fails an "
                 "assertion at start (some missing); give all three so the server runs the setting you measure")]
    bad = [f"{flag} {v!r} is not a positive whole number" for flag, v in values.items()
           if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        return bad
    steps, topk, n = int(num_steps), int(eagle_topk), int(num_draft_tokens)  # type: ignore[arg-type]
    problems: list[str] = []
    if topk == 1 and n != steps + 1:
        problems.append(f"--speculative-eagle-topk 1 with --speculative-num-draft-tokens {n}: SGLang silently rewrites "
                        f"num_draft_tokens to num_steps + 1 = {steps + 1}; pass {steps + 1}")
    if topk > 1 and n < 2:
        problems.append(f"--speculative-num-draft-tokens {n} verifies only the root token: no draft token is ever "
                        "proposed; use at least 2")
    capacity = eagle_tree_candidates(steps, topk)
    if n - 1 > capacity:
        problems.append(f"--speculative-num-draft-tokens {n} asks for {n - 1} draft tokens, but {steps} step(s) of "
                        f"top-{topk} give only {capacity} candidates (topk + (steps-1)*topk^2): SGLang's tree builder "
                        f"fails at the first decode; use at most {capacity + 1}")
    if topk > 1 and page_size is not None and page_size > 1 and attention_backend != "flashinfer":
        problems.append(f"--speculative-eagle-topk {topk} with --page-size {page_size} is refused by SGLang unless "
                        "--attention-backend flashinfer")
    return problems


def sglang_draft_algorithm(draft_config: Mapping[str, object]) -> str:
    """The `--speculative-algorithm` a draft's config.json calls for; only EAGLE-3 drafts are accepted.

    A draft reading aux hidden states (architecture LlamaForCausalLMEagle3, or an eagle_config with
    aux layers) needs EAGLE3: with EAGLE, SGLang captures no aux states and the draft runs at
    acceptance ~1.0 without an error (docs/contracts.md, failure 1). Anything else is refused, never
    mapped to EAGLE.
    """
    archs = draft_config.get("architectures") or []
    eagle = draft_config.get("eagle_config")
    uses_aux = isinstance(eagle, Mapping) and (eagle.get("use_aux_hidden_state") is True
                                               or bool(eagle.get("eagle_aux_hidden_state_layer_ids")))
    if archs == [SPECULATORS_ARCHITECTURE]:
        raise ValueError(f"this is a vLLM/speculators draft ({SPECULATORS_ARCHITECTURE}); SGLang loads the "
                         f"{SGLANG_ARCHITECTURE} export (serving.sglang.export.export_sglang)")
    if archs == [SGLANG_ARCHITECTURE] or uses_aux:
        return SGLANG_EAGLE3_ALGORITHM
    raise ValueError(f"architectures {archs!r} is not an EAGLE-3 draft ({SGLANG_ARCHITECTURE}); this pipeline only "
                     "launches EAGLE-3 drafts")


def sglang_speculative_command(target_model_path: str | Path, draft_dir: str | Path, num_steps: int, eagle_topk: int,
                               num_draft_tokens: int, cuda_graphs: bool = True, tp: int = 1, port: int = 30000, *,
                               host: str = "127.0.0.1", python: str = "python3", trust_remote_code: bool = False,
                               mem_fraction: float | None = None, cuda_graph_max_bs: int | None = None,
                               page_size: int | None = None, attention_backend: str | None = None,
                               extra_args: Sequence[str] = ()) -> list[str]:
    """`python -m sglang.launch_server ...` serving `draft_dir` on `target_model_path`, from the draft's own config.

    The algorithm comes from the checkpoint (`sglang_draft_algorithm`: EAGLE3, never EAGLE), the
    draft path is absolute (the server may run elsewhere than this process's directory), and a
    setting SGLang would rewrite or refuse raises ValueError (`sglang_speculative_problems`).
    """
    draft = Path(draft_dir).expanduser().resolve()
    config_path = draft / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {draft}: not a draft folder")
    algorithm = sglang_draft_algorithm(json.loads(config_path.read_text()))
    problems = sglang_speculative_problems(num_steps, eagle_topk, num_draft_tokens, page_size=page_size,
                                           attention_backend=attention_backend)
    if problems:
        raise ValueError("invalid speculative setting:\n" + "\n".join(problems))
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(target_model_path), "--tp", str(tp),
           "--host", host, "--port", str(port),
           "--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(draft),
           "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", str(eagle_topk),
           "--speculative-num-draft-tokens", str(num_draft_tokens)]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    if mem_fraction is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction)]
    if page_size is not None:
        cmd += ["--page-size", str(page_size)]
    if attention_backend is not None:
        cmd += ["--attention-backend", attention_backend]
    if not cuda_graphs:
        cmd.append("--disable-cuda-graph")
    elif cuda_graph_max_bs is not None:
        cmd += ["--cuda-graph-max-bs", str(cuda_graph_max_bs)]
    return cmd + list(extra_args)


@dataclass(frozen=True)
class SweepPoint:
    """One speculative setting of a sweep and the command that serves it."""

    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    cuda_graphs: bool
    command: list[str]


def speculative_sweep(target_model_path: str | Path, draft_dir: str | Path, *,
                      num_steps: Sequence[int] = (1, 2, 3, 4, 5), eagle_topk: Sequence[int] = (1, 2, 4, 8),
                      num_draft_tokens: Sequence[int] = (2, 4, 8, 16, 32), cuda_graphs: Sequence[bool] = (True, False),
                      tp: int = 1, port: int = 30000, **command_options: Any) -> Iterator[SweepPoint]:
    """Every valid (steps, topk, draft tokens, CUDA graphs) of the grid, with its SGLang command.

    With topk 1 the only valid draft-token count is steps + 1 (SGLang rewrites any other), so that
    one is used whatever `num_draft_tokens` holds; other combinations SGLang would rewrite or
    refuse are left out. `command_options` go to `sglang_speculative_command`.
    """
    seen: set[tuple[int, int, int, bool]] = set()
    for graphs in cuda_graphs:
        for steps in num_steps:
            for topk in eagle_topk:
                counts = [steps + 1] if topk == 1 else list(num_draft_tokens)
                for n in counts:
                    key = (steps, topk, n, bool(graphs))
                    if key in seen or sglang_speculative_problems(
                            steps, topk, n, page_size=command_options.get("page_size"),
                            attention_backend=command_options.get("attention_backend")):
                        continue
                    seen.add(key)
                    yield SweepPoint(steps, topk, n, bool(graphs), sglang_speculative_command(
                        target_model_path, draft_dir, steps, topk, n, bool(graphs), tp, port, **command_options))
