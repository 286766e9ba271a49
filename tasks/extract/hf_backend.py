"""Extraction backends: target hidden states (aux layers) and the teacher signal, per tokenised sample.

Owns the aux-layer convention inside the project (id i = output of decoder layer i, 0-based, i.e.
transformers' `hidden_states[i+1]`), the `Extractor` protocol any engine implements, the per-sample
record (`Extracted`) or refusal (`Quarantined`), fp8 storage with per-token scales, and the
transformers implementation `HFExtractor`. Promises: a sample's states do not depend on what it
was batched with (right padding + attention mask); a sample with any NaN/Inf in a captured state
is quarantined with the tensor named, never returned (docs/contracts.md, silent failure 8); the final
state is the post-norm one; top-k teachers only hold target ids inside the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FP8_MAX = 448.0  # largest finite float8_e4m3fn
Teacher = Literal["final_hidden", "topk"]
StorageDtype = Literal["bf16", "fp8"]
Sample = tuple[list[int], list[int]]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 default: an early, a middle and a late layer (`[1, 14, 26]` for 30 layers)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def validate_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """`ids` if they are three distinct ascending layer outputs that every engine can capture.

    The last layer (L-1) is refused: transformers' `hidden_states[L]` is the *post-norm* state, not
    the raw output of layer L-1, and SGLang ("captured before layer j") cannot express it either,
    so accepting it would store a different tensor per engine.
    """
    ids = list(ids)
    if len(ids) != 3:
        raise ValueError(f"aux layer ids must be exactly 3 (the draft's fc takes 3*H), got {ids}")
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} out of range: ids are 0-based outputs of decoder layers, "
                         f"0 <= i < {num_layers}")
    if num_layers - 1 in ids:
        raise ValueError(f"aux layer id {num_layers - 1} is the last layer, whose output transformers only "
                         "exposes after the final norm (hidden_states[-1]); use <= " f"{num_layers - 2}")
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        raise ValueError(f"aux layer ids must be distinct and ascending, got {ids}")
    return ids


@dataclass(frozen=True)
class ExtractSettings:
    aux_layer_ids: list[int]
    teacher: Teacher = "final_hidden"
    topk: int = 20
    storage: StorageDtype = "bf16"

    def __post_init__(self) -> None:
        if self.teacher not in ("final_hidden", "topk"):
            raise ValueError(f"teacher must be 'final_hidden' or 'topk', got {self.teacher!r}")
        if self.storage not in ("bf16", "fp8"):
            raise ValueError(f"storage must be 'bf16' or 'fp8', got {self.storage!r}")
        if self.teacher == "topk" and self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")


@dataclass
class Extracted:
    """One sample's record; T = sample length, H = target hidden size, k = settings.topk.

    Position t holds the states after reading token t, so its teacher predicts token t+1.
    """
    index: int
    input_ids: torch.Tensor          # int32 [T]
    loss_mask: torch.Tensor          # uint8 [T]
    aux_hidden: torch.Tensor         # bf16 or float8_e4m3fn [T, 3H], layers in aux_layer_ids order
    aux_scale: torch.Tensor | None = None       # float32 [T], fp8 only: aux = q * scale
    final_hidden: torch.Tensor | None = None    # bf16 [T, H], post-norm (teacher "final_hidden")
    topk_ids: torch.Tensor | None = None        # int32 [T, k] target ids, all inside t2d (teacher "topk")
    topk_logprobs: torch.Tensor | None = None   # float16 [T, k], log-softmax renormalised over the draft vocab
    argmax_in_draft: torch.Tensor | None = None  # bool [T]: target's full-vocab argmax is in the draft vocab

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.aux_hidden, self.aux_scale, self.final_hidden,
                                                           self.topk_ids, self.topk_logprobs, self.argmax_in_draft)
                   if t is not None)


@dataclass(frozen=True)
class Quarantined:
    index: int
    reason: str


class Extractor(Protocol):
    """An extraction engine: results in sample order, one per sample, `Extracted` or `Quarantined`."""
    settings: ExtractSettings

    def extract(self, samples: list[Sample]) -> list[Extracted | Quarantined]: ...


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (last dim) float8_e4m3fn values and float32 scales = absmax/448; x must be finite."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / FP8_MAX
    # An all-zero token gets scale 0; dividing by a tiny number instead keeps it zero rather than NaN.
    q = (x / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8(aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 states of fp8 `aux` [..., D] with per-token `scale` [...]."""
    return aux.float() * scale.float().unsqueeze(-1)


def _nonfinite(t: torch.Tensor) -> int:
    # A sum is finite only if every element is (values this size never overflow float32), and one
    # reduction is far cheaper than an elementwise mask over [T, V] logits; count only on failure.
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return 0
    return int((~torch.isfinite(t)).sum())


def precheck_samples(samples: list[Sample], vocab_size: int) -> list[Extracted | Quarantined | None]:
    """Per sample: a `Quarantined` for a sample no engine should run (empty, ids outside the vocab), else None.

    A sample whose ids and loss mask differ in length is a caller's bug, not bad data: it raises.
    """
    results: list[Extracted | Quarantined | None] = [None] * len(samples)
    for i, (ids, mask) in enumerate(samples):
        if len(ids) != len(mask):
            raise ValueError(f"sample {i}: {len(ids)} input ids but {len(mask)} loss-mask entries")
        if not ids:
            results[i] = Quarantined(i, "empty sample")
        elif min(ids) < 0 or max(ids) >= vocab_size:
            results[i] = Quarantined(i, f"token id outside the target vocab [0, {vocab_size})")
    return results


def as_result(index: int, r: Extracted | str) -> Extracted | Quarantined:
    """An engine's outcome for sample `index`: its record (index set), or a quarantine with the reason."""
    if isinstance(r, str):
        return Quarantined(index, r)
    r.index = index
    return r


def check_draft_vocab(t2d: torch.Tensor | None, vocab_size: int, topk: int) -> None:
    """The top-k teacher's draft vocab: a bool mask over the target vocab with at least `topk` tokens."""
    if t2d is None:
        raise ValueError("teacher 'topk' needs t2d, the bool mask of the draft vocab over the target vocab")
    if t2d.dtype != torch.bool or t2d.shape != (vocab_size,):
        raise ValueError(f"t2d must be bool [{vocab_size}], got {t2d.dtype} {tuple(t2d.shape)}")
    n_draft = int(t2d.sum())
    if n_draft < topk:
        raise ValueError(f"draft vocab has {n_draft} tokens, fewer than topk={topk}")


class TopkTeacher:
    """The top-k teacher from a post-norm state: the target's lm_head split once into float32 rows
    of the draft ids and of the other ids (with biases), whichever engine produced the state.

    Splitting the rows once makes the draft vocab's logits one contiguous matmul output: no
    per-sample gather of a [T, draft_vocab] copy.
    """

    def __init__(self, head_weight: torch.Tensor, head_bias: torch.Tensor | None, t2d: torch.Tensor, topk: int) -> None:
        self.vocab_size = head_weight.shape[0]
        check_draft_vocab(t2d, self.vocab_size, topk)
        self.topk = topk
        weight = head_weight.float()
        bias = None if head_bias is None else head_bias.float()
        t2d = t2d.to(weight.device)
        self.draft_ids = torch.nonzero(t2d).squeeze(1)  # ascending target ids
        self.other_ids = torch.nonzero(~t2d).squeeze(1)
        self.draft_w, self.other_w = weight[self.draft_ids].contiguous(), weight[self.other_ids].contiguous()
        self.draft_b = None if bias is None else bias[self.draft_ids]
        self.other_b = None if bias is None else bias[self.other_ids]

    def fill(self, final: torch.Tensor, rec: Extracted) -> str | None:
        """Fill rec's top-k teacher from the post-norm state; a reason if the logits are not finite.

        The same numbers as log_softmax over the draft ids of the full float32 logits, then top-k,
        then the full-vocab argmax, computed without materialising either: logits of the draft ids
        and of the others come from two matmuls; the normaliser is a log-sum-exp; the target's
        argmax is a draft token when the best draft logit beats the best other one.
        """
        state = final.to(self.draft_w.device).float()
        draft_logits = F.linear(state, self.draft_w, self.draft_b)  # [T, n_draft], ascending target ids
        other_logits = F.linear(state, self.other_w, self.other_b)  # [T, V - n_draft]
        if c := _nonfinite(draft_logits) + _nonfinite(other_logits):
            return f"{c} non-finite values in target logits"
        # Renormalised over the draft vocab: the loss is forward KL against the target's softmax
        # *restricted to* the draft vocab, i.e. p(v | v in draft); the trainer needs no extra mass term.
        values, pos = draft_logits.topk(self.topk, dim=-1)
        rec.topk_logprobs = (values - torch.logsumexp(draft_logits, dim=-1, keepdim=True)).to(torch.float16).cpu()
        rec.topk_ids = self.draft_ids[pos].to(torch.int32).cpu()
        # Renormalising hides how much mass lay outside the draft vocab; the trainer masks positions
        # whose target argmax is outside it (docs/contracts.md), so that bit is kept here.
        best_draft = values[:, 0]
        if other_logits.shape[1] == 0:
            rec.argmax_in_draft = torch.ones_like(best_draft, dtype=torch.bool).cpu()
            return None
        best_other, other_pos = other_logits.max(dim=-1)
        in_draft = best_draft > best_other
        # A tie goes to the lower target id, as argmax over the full vocab does.
        tie = best_draft == best_other
        if bool(tie.any()):
            first_draft = torch.where(draft_logits[tie] == best_draft[tie, None], self.draft_ids,
                                      self.vocab_size).amin(dim=-1)
            in_draft[tie] = first_draft < self.other_ids[other_pos[tie]]
        rec.argmax_in_draft = in_draft.cpu()
        return None


def record_from_states(ids: list[int], mask: list[int], layers: list[torch.Tensor], final: torch.Tensor,
                       labels: list[str], settings: ExtractSettings, teacher: TopkTeacher | None) -> Extracted | str:
    """One sample's record (index unset) from its aux layers [T, H] each and post-norm state [T, H],
    or the quarantine reason naming each non-finite tensor (`labels`: the layers', then the final's).

    Tensors are copied out (`copy=True`): inference tensors would fail in any later autograd use
    (online training), and slices would keep a whole batch's states alive.
    """
    reasons = [f"{c} non-finite values in {label}"
               for label, t in zip(labels, [*layers, final]) if (c := _nonfinite(t))]
    if reasons:
        return "; ".join(reasons)
    aux = torch.cat(layers, dim=-1)
    rec = Extracted(index=-1, input_ids=torch.tensor(ids, dtype=torch.int32),
                    loss_mask=torch.tensor(mask, dtype=torch.uint8), aux_hidden=aux)
    if settings.storage == "fp8":
        rec.aux_hidden, rec.aux_scale = (t.cpu() for t in quantize_fp8(aux))
    else:
        rec.aux_hidden = aux.to("cpu", torch.bfloat16, copy=True)
    if settings.teacher == "final_hidden":
        rec.final_hidden = final.to("cpu", torch.bfloat16, copy=True)
        return rec
    reason = teacher.fill(final, rec)
    return reason if reason else rec


class HFExtractor:
    """A transformers causal LM as extraction engine, for targets that fit one process."""

    def __init__(self, model: PreTrainedModel, settings: ExtractSettings, t2d: torch.Tensor | None = None,
                 max_batch_tokens: int = 8192, pad_token_id: int = 0) -> None:
        cfg = model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.vocab_size: int = cfg.vocab_size
        validate_aux_layer_ids(settings.aux_layer_ids, self.num_layers)
        if settings.teacher == "topk":
            check_draft_vocab(t2d, self.vocab_size, settings.topk)
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.model = model
        self.settings = settings
        self.t2d = t2d
        self.max_batch_tokens = max_batch_tokens
        self.pad_token_id = pad_token_id
        self._teacher: TopkTeacher | None = None

    @property
    def teacher(self) -> TopkTeacher | None:
        """The top-k teacher over the model's own lm_head, built on first use (None for final_hidden)."""
        if self.settings.teacher != "topk":
            return None
        if self._teacher is None:
            head = self.model.get_output_embeddings()
            self._teacher = TopkTeacher(head.weight.detach(), None if head.bias is None else head.bias.detach(),
                                        self.t2d.to(head.weight.device), self.settings.topk)
        return self._teacher

    def batches(self, samples: list[Sample]) -> list[list[int]]:
        """Sample indices grouped so that batch size x longest length <= max_batch_tokens.

        Sorted by length first so right padding wastes little; a sample longer than the budget
        runs alone.
        """
        order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
        out: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            n = len(samples[i][0])  # ascending, so n is the longest of cur + [i]
            if cur and n * (len(cur) + 1) > self.max_batch_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
        return out

    def extract(self, samples: list[Sample]) -> list[Extracted | Quarantined]:
        results = precheck_samples(samples, self.vocab_size)
        todo = [(i, s) for i, s in enumerate(samples) if results[i] is None]
        kept = [s for _, s in todo]
        for batch in self.batches(kept):
            for j, r in zip(batch, self._run([kept[j] for j in batch])):
                results[todo[j][0]] = as_result(todo[j][0], r)
        return results  # type: ignore[return-value]  # every slot is filled above

    @torch.no_grad()
    def _run(self, batch: list[Sample]) -> list[Extracted | str]:
        """Extracted records (index unset) or quarantine reasons, in batch order.

        Records are built outside inference mode and copied out of the batch tensors: inference
        tensors would fail in any later autograd use (online training), and slices would keep the
        whole batch's states alive.
        """
        lengths = [len(ids) for ids, _ in batch]
        width = max(lengths)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for b, (ids, _) in enumerate(batch):
            input_ids[b, :lengths[b]] = torch.tensor(ids)
            attention[b, :lengths[b]] = 1
        hs = self._forward(input_ids, attention)
        assert len(hs) == self.num_layers + 1, f"expected {self.num_layers + 1} hidden states, got {len(hs)}"
        layer_ids = self.settings.aux_layer_ids
        labels = [f"aux layer {i} (hidden_states[{i + 1}])" for i in layer_ids] + ["final_hidden (post-norm hidden_states[-1])"]
        return [record_from_states(ids, mask, [hs[i + 1][b, :lengths[b]] for i in layer_ids], hs[-1][b, :lengths[b]],
                                   labels, self.settings, self.teacher)
                for b, (ids, mask) in enumerate(batch)]

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """All hidden states: [embeddings, output of layers 0..L-2, post-norm final], each [B, T, H]."""
        device = self.model.device
        # The base model only: the final_hidden teacher needs no logits, and the top-k teacher
        # recomputes them in float32 from the post-norm state (more exact than bf16 logits).
        out = self.model.base_model(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                    output_hidden_states=True, use_cache=False)
        return out.hidden_states


def build_extractor(backend: str, model: PreTrainedModel, tokenizer, settings: ExtractSettings,
                    t2d: torch.Tensor | None, max_batch_tokens: int) -> Extractor:
    """The configured in-process engine. The `vllm` backend runs in a server this process starts
    (`tasks.extract.vllm_backend.open_vllm_extractor`): the flow only sees the `Extractor` protocol."""
    if backend == "hf":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return HFExtractor(model, settings, t2d=t2d if settings.teacher == "topk" else None,
                           max_batch_tokens=max_batch_tokens, pad_token_id=pad)
    if backend == "vllm":
        raise ValueError("backend 'vllm' extracts through a vLLM server: use tasks.extract.vllm_backend.open_vllm_extractor")
    raise ValueError(f"unknown extraction backend {backend!r} (available: 'hf', 'vllm')")


# ---------------------------------------------------------------- the shard record format
# One sample as the shard store packs it (token-aligned tensors, dim 0 = T). Training reads these
# keys back; changing them is a format change (SHARD_FORMAT) that old shards must be refused by.
SHARD_FORMAT = "eagle3-extract-v1"
RECORD_KEYS = ("input_ids", "loss_mask", "aux_hidden", "aux_scale", "final_hidden", "topk_ids", "topk_logprobs",
               "argmax_in_draft")


def record_tensors(rec: Extracted) -> dict[str, torch.Tensor]:
    """The record's tensors by name, without the ones its settings do not produce."""
    return {k: getattr(rec, k) for k in RECORD_KEYS if getattr(rec, k) is not None}


def record_from_tensors(tensors: dict[str, torch.Tensor], index: int = -1) -> Extracted:
    """The inverse of `record_tensors` (e.g. one entry of `storage.shards.unpack_samples`)."""
    unknown = set(tensors) - set(RECORD_KEYS)
    if unknown or not {"input_ids", "loss_mask", "aux_hidden"} <= set(tensors):
        raise ValueError(f"not an extract record: keys {sorted(tensors)}")
    return Extracted(index=index, **{k: tensors[k] for k in RECORD_KEYS if k in tensors})


def aux_hidden_float(rec: Extracted) -> torch.Tensor:
    """The aux states as float32 [T, 3H], whatever the storage dtype."""
    if rec.aux_scale is not None:
        return dequantize_fp8(rec.aux_hidden, rec.aux_scale)
    return rec.aux_hidden.float()
