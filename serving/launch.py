"""Launch commands across engines: the production baseline's settings and its check, and reading a command line.

Owns `BaselineSpec` (what a baseline server runs, one spec for every engine), `kimi_k25_baseline`,
`baseline_options` (the options every engine's baseline shares),
`validate_baseline_command`, `engine_arguments` (does this command start that engine, and its own
arguments) and `flag_values`. Each engine's command lines are its package's: SGLang's
(serving/sglang/server.py: baseline and speculative), vLLM's (serving/vllm/server.py), llama.cpp's
(serving/llamacpp/server.py). Promises: a baseline command either validates with no problems or each
problem is one readable line: a "baseline" that speculates, runs eagerly, runs remote code unasked
or spans the wrong GPU count would make every speedup measured against it wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

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


def baseline_options(spec: BaselineSpec, *, context_flag: str, mem_flag: str, tool_flags: Sequence[str]) -> list[str]:
    """The options every engine's baseline command shares, in that engine's spelling, then `spec.extra_args`.

    tool_flags: the flags before the tool-call parser's name (vLLM also needs --enable-auto-tool-choice).
    """
    options: list[str] = []
    if spec.trust_remote_code:
        options.append("--trust-remote-code")
    if spec.served_model_name:
        options += ["--served-model-name", spec.served_model_name]
    if spec.context_length:
        options += [context_flag, str(spec.context_length)]
    if spec.mem_fraction is not None:
        options += [mem_flag, str(spec.mem_fraction)]
    if spec.tool_call_parser:
        options += [*tool_flags, spec.tool_call_parser]
    if spec.reasoning_parser:
        options += ["--reasoning-parser", spec.reasoning_parser]
    return options + list(spec.extra_args)


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


def engine_arguments(argv: Sequence[str], engine: Engine) -> list[str] | None:
    """The engine's own arguments in a launch command (after `-m sglang.launch_server`, `vllm serve`, `llama-server`); None if it does not start `engine`."""
    ok, start = _launches(argv, engine)
    return list(argv[start:]) if ok else None


def flag_values(argv: Sequence[str], names: Sequence[str]) -> list[str | None]:
    """Every value given to any of `names` (`--flag value`, `--flag=value`, `_` for `-` accepted)."""
    return _flag_values(argv, names)
