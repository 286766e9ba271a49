"""vLLM serving the target for generation: alone, with our EAGLE-3 draft, or with its own n-gram method.

Owns the production baseline's command line (`vllm_baseline_command`), `--speculative-config` for serving (method `eagle3` on a speculators-format export, method
`ngram` for vLLM's prompt lookup), the flag that puts vLLM's own per-request acceptance counters into
every response (`--per-request-spec-decode-metrics summary`), and what vLLM's log says it loaded for
a draft: the aux layers it captures, whether it shares the target's embeddings, whose lm_head it
uses. Promises: a server asked to speculate either logs that it loaded the drafter or fails to start
with its log; what it loaded is read from vLLM's own lines, never assumed from the files we wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from serving.launch import BaselineSpec, baseline_options
from serving.process import ServerStartError
from serving.vllm.extract_server import VllmEngineArgs, VllmServer

VllmMethod = Literal["eagle3", "ngram"]

# vLLM 0.32's lines (v1/worker/gpu_model_runner.py, v1/spec_decode/llm_base_proposer.py), which the CPU runner
# inherits. Without "Using auxiliary layers from speculative config" vLLM took the target model's defaults.
_AUX_FROM_CONFIG = re.compile(r"Using (?:Eagle3 )?auxiliary layers from (?:speculative )?config: \(?([0-9, ]+)\)?")
_AUX_FROM_MODEL = re.compile(r"Using (?:Eagle3 auxiliary layers from model|model's default auxiliary layers): "
                             r"\(?([0-9, ]+)\)?")
_EMBED_SHARED = ("Sharing target model embedding weights with the draft model",)
_EMBED_OWN = ("Keeping separate embedding weights from the target model",
              "vocab embedding will be loaded separately from the target model")
_HEAD_OWN = ("Keeping separate lm_head weights from the target model",)
_HEAD_SHARED = ("Sharing target model lm_head weights with the draft model",)


def vllm_baseline_command(spec: BaselineSpec, vllm: str = "vllm") -> list[str]:
    """`vllm serve MODEL ...` for the baseline: tensor parallel, CUDA graphs on, no speculation."""
    cmd = [vllm, "serve", spec.model_path, "--tensor-parallel-size", str(spec.gpus), "--host", spec.host,
           "--port", str(spec.port)]
    return cmd + baseline_options(spec, context_flag="--max-model-len", mem_flag="--gpu-memory-utilization",
                                  tool_flags=("--enable-auto-tool-choice", "--tool-call-parser"))


@dataclass(frozen=True)
class VllmSpeculation:
    """vLLM's speculative decoding: our EAGLE-3 export (speculators format) or n-gram lookup in the context."""

    method: VllmMethod
    num_speculative_tokens: int = 3  # draft tokens per verify round (chain depth k)
    draft: Path | None = None  # the speculators-format export, for eagle3
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    prompt_lookup_max: int = 3  # ngram: longest suffix matched
    name: str = ""  # eagle3: which draft, in the label, when one benchmark serves several

    def __post_init__(self) -> None:
        if (self.method == "eagle3") != (self.draft is not None):
            raise ValueError(f"vLLM method {self.method} {'needs' if self.draft is None else 'takes no'} draft folder")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")

    def config(self) -> dict:
        """The JSON of `--speculative-config`."""
        if self.method == "eagle3":
            return {"method": "eagle3", "model": str(Path(self.draft).resolve()),
                    "num_speculative_tokens": self.num_speculative_tokens}
        return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}

    @property
    def label(self) -> str:
        """`eagle3-k3`, `eagle3-<name>-k3`; `ngram-k3`, or `ngram-k3-2:4` for a lookup window other than 1:3."""
        name = f"-{self.name}" if self.name else ""
        window = (self.prompt_lookup_min, self.prompt_lookup_max)
        lookup = f"-{window[0]}:{window[1]}" if self.method == "ngram" and window != (1, 3) else ""
        return f"{self.method}{name}-k{self.num_speculative_tokens}{lookup}"


@dataclass(frozen=True)
class LoadedDraft:
    """What vLLM's log says it did with a draft at start-up (None: it said nothing about it)."""

    aux_layer_ids: tuple[int, ...] | None  # the ids vLLM captures ("before layer j")
    aux_from_config: bool | None  # True: the draft's config; False: the target model's defaults
    shares_target_embeddings: bool | None
    own_lm_head: bool | None  # True: the draft's lm_head (ours is over the draft vocab); False: the target's


def read_loaded_draft(log_text: str) -> LoadedDraft:
    """Parse vLLM's start-up lines about its drafter (the last start in `log_text` wins)."""
    aux, from_config = None, None
    for line in log_text.splitlines():
        if m := _AUX_FROM_CONFIG.search(line):
            aux, from_config = _ints(m.group(1)), True
        elif m := _AUX_FROM_MODEL.search(line):
            aux, from_config = _ints(m.group(1)), False
    return LoadedDraft(aux, from_config, _last_said(log_text, _EMBED_SHARED, _EMBED_OWN),
                       _last_said(log_text, _HEAD_OWN, _HEAD_SHARED))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def _last_said(text: str, yes: tuple[str, ...], no: tuple[str, ...]) -> bool | None:
    """True if the last of these lines in `text` is a `yes` line, False if a `no` line, None if neither occurs."""
    last_yes = max((text.rfind(s) for s in yes), default=-1)
    last_no = max((text.rfind(s) for s in no), default=-1)
    if last_yes < 0 and last_no < 0:
        return None
    return last_yes > last_no


class VllmSpecServer(VllmServer):
    """`vllm serve` for generation, optionally speculating, with per-request acceptance counters in responses.

    `with VllmSpecServer(VllmEngineArgs(model=folder), speculation=VllmSpeculation("eagle3", 3, export)) as s:`
    then `s.loaded_draft` says what vLLM loaded.
    """

    def __init__(self, engine: VllmEngineArgs, speculation: VllmSpeculation | None = None, **kwargs):
        super().__init__(engine, **kwargs)
        self.speculation = speculation
        self.loaded_draft: LoadedDraft | None = None

    def describe(self) -> str:
        how = "" if self.speculation is None else f" with {self.speculation.label}"
        return f"the vLLM server on {self.engine.model}{how}"

    def own_args(self) -> list[str]:
        # Prefix caching off: a level would otherwise skip the prefill of prompts an earlier level sent.
        args = ["--no-enable-prefix-caching", "--seed", "0"]
        if self.speculation is not None:
            args += ["--speculative-config", json.dumps(self.speculation.config()),
                     "--per-request-spec-decode-metrics", "summary"]
        return args

    def check_before_start(self) -> None:
        super().check_before_start()
        s = self.speculation
        if s is not None and s.draft is not None and not (Path(s.draft) / "config.json").is_file():
            raise FileNotFoundError(f"no draft folder at {s.draft} (config.json missing): export the draft in the "
                                    "speculators format (train.export_formats: [..., speculators])")

    def after_start(self) -> None:
        super().after_start()
        if self.speculation is None or self.speculation.method != "eagle3":
            return
        self.loaded_draft = read_loaded_draft(self.log_tail_all())
        if self.loaded_draft.aux_layer_ids is None and self.loaded_draft.own_lm_head is None:
            log = self.log_tail()
            self.stop()
            raise ServerStartError(f"{self.describe()} answers, but its log says nothing about loading the EAGLE-3 "
                                   f"drafter: it may serve without it; log {self.log_path}, last lines:\n{log}")

    def log_tail_all(self) -> str:
        """Everything this start wrote to the log."""
        if self.log_path is None:
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode(errors="replace")
