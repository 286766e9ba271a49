"""vLLM's aux-layer id convention: the ids a speculators draft names, and the ids the hidden-states extraction asks for.

Owns `vllm_capture_layers` (vLLM's capture rule: id j is the state entering layer j), `vllm_layer_ids`
(the draft's top-level `eagle_aux_hidden_state_layer_ids` for trained layers in the project
convention, output of layer i, 0-based) and `extraction_layer_ids` (the same ids plus the last
layer's output, which the extraction server also captures). Promises: one rule, i -> i + 1, for
serving and extraction alike (docs/contracts.md, failure 4).
"""

from __future__ import annotations

from collections.abc import Sequence


def vllm_capture_layers(written_ids: Sequence[int], num_layers: int) -> list[int | None]:
    """vLLM captures the state entering layer j for each written id j: project id j-1."""
    return [int(j) - 1 if 1 <= int(j) < num_layers else None for j in written_ids]


def vllm_layer_ids(aux_layer_ids: Sequence[int]) -> list[int]:
    """Top-level `eagle_aux_hidden_state_layer_ids` for vLLM/speculators ("captured before layer j")."""
    return [int(i) + 1 for i in aux_layer_ids]


def extraction_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM's ids for our aux layers, then the last layer's output (pre-norm).

    vLLM captures id j *before* decoder layer j runs (`_maybe_add_hidden_state(idx + 1, ...)` after
    layer idx), i.e. the output of layer j-1: our id i (output of layer i) is vLLM's i+1. Id
    `num_layers` is the output of the last layer, before the final norm, from which the teacher's
    post-norm state is computed.
    """
    if any(not 0 <= i < num_layers - 1 for i in aux_layer_ids):
        raise ValueError(f"aux layer ids {list(aux_layer_ids)} out of range for {num_layers} layers")
    return vllm_layer_ids(aux_layer_ids) + [num_layers]
