"""Command lines of the production servers: the baselines (no speculation) and speculative SGLang.

Promises: a baseline command either validates with no problems or each problem is one readable
line: a "baseline" that speculates, runs eagerly, runs remote code unasked or spans the wrong GPU
count would make every speedup measured against it wrong. Speculative SGLang commands are built
from the draft checkpoint itself (EAGLE3 for an EAGLE-3 draft, never EAGLE) and only for settings
SGLang runs as given. The embedded llama.cpp server's process lives in `serving.llamacpp.server`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Engine = Literal["sglang", "vllm", "llamacpp"]  # llamacpp: `llama-server` (launch checks only, no baseline)

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
        elif engine == "llamacpp":
            if Path(token).name == "llama-server":
                return True, i + 1
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
    acceptance ~1.0 without an error (CONTRACTS.md, failure 1). Anything else is refused, never
    mapped to EAGLE.
    """
    from tasks.export.checkpoint import SGLANG_ARCHITECTURE, SPECULATORS_ARCHITECTURE

    archs = draft_config.get("architectures") or []
    eagle = draft_config.get("eagle_config")
    uses_aux = isinstance(eagle, Mapping) and (eagle.get("use_aux_hidden_state") is True
                                               or bool(eagle.get("eagle_aux_hidden_state_layer_ids")))
    if archs == [SPECULATORS_ARCHITECTURE]:
        raise ValueError(f"this is a vLLM/speculators draft ({SPECULATORS_ARCHITECTURE}); SGLang loads the "
                         f"{SGLANG_ARCHITECTURE} export (tasks.export.checkpoint.export_sglang)")
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
    config_path = draft / "config.json"
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


def engine_arguments(argv: Sequence[str], engine: Engine) -> list[str] | None:
    """The engine's own arguments in a launch command (after `-m sglang.launch_server`, `vllm serve`, `llama-server`); None if it does not start `engine`."""
    ok, start = _launches(argv, engine)
    return list(argv[start:]) if ok else None


def flag_values(argv: Sequence[str], names: Sequence[str]) -> list[str | None]:
    """Every value given to any of `names` (`--flag value`, `--flag=value`, `_` for `-` accepted)."""
    return _flag_values(argv, names)
