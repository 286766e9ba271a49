"""The `train` section: the EAGLE-3 draft's training run, its rounds, schedule and exports."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.base import Strict, TargetConfig


class TrainConfig(Strict):
    """Parameters of the `train` flow: the EAGLE-3 draft on extracted shards (or online), in rounds."""

    workspace: str = "runs/demo"
    run_name: str = Field(default="draft", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                          description="Names the training run; rerunning with the same name resumes it.")
    mode: Literal["offline", "online"] = Field(
        default="offline", description="offline: read extracted shards; online: compute states on the fly, no disk.")
    extract_key: str | None = Field(default=None, description="Which extraction's shards (default: the latest).")
    target: TargetConfig = Field(default_factory=TargetConfig)
    ttt_steps: int = Field(default=7, ge=1, le=16)
    init: Literal["random", "target_head"] = Field(
        default="random", description="How a new draft starts. target_head: lm_head from the target's head rows of the "
                                      "draft vocab and norm from the target's final norm (the rest random); on SmolLM2 "
                                      "it measured worse than random at 12.5K and 25K tokens (benchmarks/README, "
                                      "selection).")
    head: Literal["trained", "frozen"] = Field(
        default="trained", description="frozen: the draft's lm_head keeps the target's own head rows of the draft "
                                       "vocab and is never updated (needs init: target_head), as speculators trains "
                                       "it; on a tied-embedding target the head is the draft's largest matrix.")
    norm_before_fc: bool = Field(default=False, description="Eagle 3.1: an RMSNorm over the three aux states before fc. "
                                                            "Served by vLLM only (export_formats: [speculators]).")
    norm_output: bool = Field(default=False, description="Eagle 3.1: each draft step hands the next its normed output, "
                                                         "not the raw one. Served by vLLM only.")
    step_decay: float = Field(default=0.8, gt=0, le=1)
    loss_positions: Literal["argmax_in_draft", "all"] = Field(
        default="argmax_in_draft", description="Where the loss trains: at the positions whose target argmax is a draft "
                                               "token (elsewhere no draft token can be accepted), or at all "
                                               "loss-masked positions toward the target's distribution renormalised "
                                               "over the draft vocab (speculators'). The metrics and validation count "
                                               "the first kind either way.")
    epochs: int = Field(default=1, ge=1, description="Passes over each round's shards.")
    batch_tokens: int = Field(default=8192, ge=16, description="Padded tokens per micro-batch.")
    grad_accum: int = Field(default=1, ge=1, description="Micro-batches per optimizer step (per process).")
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    optimizer: Literal["adamw", "muon"] = Field(
        default="adamw", description="muon: Muon (orthogonalized momentum) on fc and the decoder layer's matrices, "
                                     "AdamW on norms and lm_head, at the same lr: speculators' default.")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        default="constant", description="After warmup: constant, or a decay to min_lr_ratio (cosine; linear, as "
                                        "speculators does with a floor of 0).")
    warmup_steps: int = Field(default=0, ge=0)
    total_steps: int | None = Field(default=None, ge=1, description="Decay horizon in optimizer steps over the whole "
                                                                 "run. Default: one cycle per round (warmup, then decay "
                                                                 "over all the round's epochs), so every round's export "
                                                                 "is a decayed draft.")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    grad_clip: float = Field(default=0.5, gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    seed: int = 0
    checkpoint_every: int = Field(default=200, ge=1, description="Optimizer steps between checkpoints.")
    keep_checkpoints: int = Field(default=2, ge=1)
    log_every: int = Field(default=10, ge=1)
    delete_consumed: bool = Field(default=True, description="Delete a round's shards once trained on (frees the budget).")
    replay_kept_shards: bool = Field(
        default=False, description="Also train on shards that other runs consumed and kept (their delete_consumed: "
                                   "false): several recipes on one extraction. Such a run deletes nothing.")
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this many optimizer steps in total.")
    validation_samples: int = Field(
        default=0, ge=0, description="Samples of each round held out of training (chosen by seed): the draft's "
                                     "expected acceptance on them is measured every `validate_every` steps and at "
                                     "the end of each epoch, and the round's export is the best draft so measured, "
                                     "not the last. 0: no validation, the last draft is exported.")
    validate_every: int | None = Field(default=None, ge=1,
                                       description="Optimizer steps between validations (default: checkpoint_every).")
    export_formats: list[Literal["sglang", "speculators", "gguf"]] = Field(
        default_factory=lambda: ["sglang", "speculators", "gguf"],
        description="Formats exported after each round. gguf (llama.cpp) is converted from the sglang export by "
                    "llama.cpp's convert_hf_to_gguf.py (needs sentencepiece and the pinned llama.cpp source).")
    gguf_outtype: Literal["f32", "f16", "bf16", "q8_0"] = Field(
        default="f32", description="Weight type of the gguf export (f32 keeps the bf16 export's values exactly).")

    @model_validator(mode="after")
    def _horizon(self) -> "TrainConfig":
        if self.head == "frozen" and self.init != "target_head":
            raise ValueError("head: frozen keeps the head it starts with; it needs init: target_head "
                             "(a frozen random head would never learn)")
        if (self.norm_before_fc or self.norm_output) and set(self.export_formats) - {"speculators"}:
            raise ValueError("norm_before_fc / norm_output (Eagle 3.1) are served by vLLM only: SGLang and llama.cpp "
                             "would serve the draft without them; set export_formats: [speculators]")
        if self.replay_kept_shards and self.delete_consumed:
            raise ValueError("replay_kept_shards trains on shards other runs keep; it needs delete_consumed: false")
        if len(set(self.export_formats)) != len(self.export_formats):
            raise ValueError(f"export_formats lists a format twice: {self.export_formats}")
        if "gguf" in self.export_formats and "sglang" not in self.export_formats:
            raise ValueError("export_formats: gguf is converted from the sglang export; list sglang too")
        return self
