"""Extraction backends: target hidden states (aux layers) and the teacher signal, per tokenised sample.

Owns the aux-layer convention inside the project (id i = output of decoder layer i, 0-based, i.e.
transformers' `hidden_states[i+1]`), the `Extractor` protocol any engine implements, the per-sample
record (`Extracted`) or refusal (`Quarantined`), fp8 storage with per-token scales, and the
transformers implementation `HFExtractor`. Promises: a sample's states do not depend on what it
was batched with (right padding + attention mask); a sample with any NaN/Inf in a captured state
is quarantined with the tensor named, never returned (CONTRACTS.md, silent failure 8); the final
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


class HFExtractor:
    """A transformers causal LM as extraction engine, for targets that fit one process."""

    def __init__(self, model: PreTrainedModel, settings: ExtractSettings, t2d: torch.Tensor | None = None,
                 max_batch_tokens: int = 8192, pad_token_id: int = 0) -> None:
        cfg = model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.vocab_size: int = cfg.vocab_size
        validate_aux_layer_ids(settings.aux_layer_ids, self.num_layers)
        if settings.teacher == "topk":
            if t2d is None:
                raise ValueError("teacher 'topk' needs t2d, the bool mask of the draft vocab over the target vocab")
            if t2d.dtype != torch.bool or t2d.shape != (self.vocab_size,):
                raise ValueError(f"t2d must be bool [{self.vocab_size}], got {t2d.dtype} {tuple(t2d.shape)}")
            n_draft = int(t2d.sum())
            if n_draft < settings.topk:
                raise ValueError(f"draft vocab has {n_draft} tokens, fewer than topk={settings.topk}")
            self.draft_ids = torch.nonzero(t2d).squeeze(1).to(model.device)  # ascending target ids
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.model = model
        self.settings = settings
        self.t2d = t2d
        self.max_batch_tokens = max_batch_tokens
        self.pad_token_id = pad_token_id
        self._head_rows: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None = None

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
        results: list[Extracted | Quarantined | None] = [None] * len(samples)
        for i, (ids, mask) in enumerate(samples):
            if len(ids) != len(mask):
                raise ValueError(f"sample {i}: {len(ids)} input ids but {len(mask)} loss-mask entries")
            if not ids:
                results[i] = Quarantined(i, "empty sample")
            elif min(ids) < 0 or max(ids) >= self.vocab_size:
                results[i] = Quarantined(i, f"token id outside the target vocab [0, {self.vocab_size})")
        todo = [(i, s) for i, s in enumerate(samples) if results[i] is None]
        kept = [s for _, s in todo]
        for batch in self.batches(kept):
            for j, r in zip(batch, self._run([kept[j] for j in batch])):
                index = todo[j][0]
                if isinstance(r, str):
                    results[index] = Quarantined(index, r)
                else:
                    r.index = index
                    results[index] = r
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
        results: list[Extracted | str] = []
        for b, (ids, mask) in enumerate(batch):
            n = lengths[b]
            layers = [hs[i + 1][b, :n] for i in layer_ids]
            final = hs[-1][b, :n]
            reasons = [f"{c} non-finite values in aux layer {i} (hidden_states[{i + 1}])"
                       for i, layer in zip(layer_ids, layers) if (c := _nonfinite(layer))]
            if c := _nonfinite(final):
                reasons.append(f"{c} non-finite values in final_hidden (post-norm hidden_states[-1])")
            if reasons:
                results.append("; ".join(reasons))
                continue
            aux = torch.cat(layers, dim=-1)
            rec = Extracted(index=-1, input_ids=torch.tensor(ids, dtype=torch.int32),
                            loss_mask=torch.tensor(mask, dtype=torch.uint8), aux_hidden=aux)
            if self.settings.storage == "fp8":
                rec.aux_hidden, rec.aux_scale = (t.cpu() for t in quantize_fp8(aux))
            else:
                rec.aux_hidden = aux.to("cpu", torch.bfloat16, copy=True)
            if self.settings.teacher == "final_hidden":
                rec.final_hidden = final.to("cpu", torch.bfloat16, copy=True)
            else:
                reason = self._topk(final, rec)
                if reason:
                    results.append(reason)
                    continue
            results.append(rec)
        return results

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """All hidden states: [embeddings, output of layers 0..L-2, post-norm final], each [B, T, H]."""
        device = self.model.device
        # The base model only: the final_hidden teacher needs no logits, and the top-k teacher
        # recomputes them in float32 from the post-norm state (more exact than bf16 logits).
        out = self.model.base_model(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                    output_hidden_states=True, use_cache=False)
        return out.hidden_states

    def _split_head(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The target's lm_head as float32 rows of the draft ids, then of the other ids (with biases), built once.

        Splitting the rows once makes the draft vocab's logits one contiguous matmul output: no
        per-sample gather of a [T, draft_vocab] copy.
        """
        if self._head_rows is None:
            head = self.model.get_output_embeddings()
            weight = head.weight.detach().float()
            bias = None if head.bias is None else head.bias.detach().float()
            other_ids = torch.nonzero(~self.t2d.to(weight.device)).squeeze(1)
            self.other_ids = other_ids
            self._head_rows = (weight[self.draft_ids].contiguous(), None if bias is None else bias[self.draft_ids],
                               weight[other_ids].contiguous(), None if bias is None else bias[other_ids])
        return self._head_rows

    def _topk(self, final: torch.Tensor, rec: Extracted) -> str | None:
        """Fill rec's top-k teacher from the post-norm state; a reason if the logits are not finite.

        The same numbers as log_softmax over the draft ids of the full float32 logits, then top-k,
        then the full-vocab argmax, computed without materialising either: logits of the draft ids
        and of the others come from two matmuls; the normaliser is a log-sum-exp; the target's
        argmax is a draft token when the best draft logit beats the best other one.
        """
        draft_w, draft_b, other_w, other_b = self._split_head()
        state = final.float()
        draft_logits = F.linear(state, draft_w, draft_b)  # [T, n_draft], ascending target ids
        other_logits = F.linear(state, other_w, other_b)  # [T, V - n_draft]
        if c := _nonfinite(draft_logits) + _nonfinite(other_logits):
            return f"{c} non-finite values in target logits"
        # Renormalised over the draft vocab: the loss is forward KL against the target's softmax
        # *restricted to* the draft vocab, i.e. p(v | v in draft); the trainer needs no extra mass term.
        values, pos = draft_logits.topk(self.settings.topk, dim=-1)
        rec.topk_logprobs = (values - torch.logsumexp(draft_logits, dim=-1, keepdim=True)).to(torch.float16).cpu()
        rec.topk_ids = self.draft_ids[pos].to(torch.int32).cpu()
        # Renormalising hides how much mass lay outside the draft vocab; the trainer masks positions
        # whose target argmax is outside it (CONTRACTS), so that bit is kept here.
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


def build_extractor(backend: str, model: PreTrainedModel, tokenizer, settings: ExtractSettings,
                    t2d: torch.Tensor | None, max_batch_tokens: int) -> Extractor:
    """The configured engine. Another engine (an SGLang-based one for 1T-parameter targets) is one
    more branch here: the flow only sees the `Extractor` protocol."""
    if backend == "hf":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return HFExtractor(model, settings, t2d=t2d if settings.teacher == "topk" else None,
                           max_batch_tokens=max_batch_tokens, pad_token_id=pad)
    raise ValueError(f"unknown extraction backend {backend!r} (available: 'hf')")


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
