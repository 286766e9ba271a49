"""llama.cpp's aux-layer id convention: `eagle3.target_layers` name layer *inputs*.

Owns `llamacpp_capture_layers` (llama.cpp's capture rule: id k is the input of layer k, the output of
layer k-1), `llamacpp_layer_ids` (the ids for trained layers in the project convention, output of
layer i, 0-based: i + 1), `default_ids` (what the converter writes when the draft names none) and
`wanted_ids`. Promises: an id that selects the embeddings or the target's nextn state is no layer
output and is refused or reported as None, never silently shifted (docs/contracts.md, failure 4).
"""

from __future__ import annotations

from collections.abc import Sequence


def llamacpp_capture_layers(written_ids: Sequence[int], num_layers: int) -> list[int | None]:
    """Which "output of layer i" llama.cpp captures for each written id (None: not a layer output).

    llama.cpp captures the input of layer k (`t_layer_inp[k]`), the output of layer k-1; k = 0 is
    the embeddings and k = num_layers selects the target's nextn state, neither a layer output.
    """
    return [int(k) - 1 if 1 <= int(k) < num_layers else None for k in written_ids]


def llamacpp_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The `eagle3.target_layers` that make llama.cpp capture `aux_layer_ids` (project convention): i + 1."""
    ids = [int(i) for i in aux_layer_ids]
    if len(ids) != 3:
        raise ValueError(f"llama.cpp's EAGLE-3 takes exactly 3 aux layers, got {len(ids)}: {ids}")
    for i in ids:
        if i < 0 or i + 1 > num_layers:
            raise ValueError(f"aux layer {i} is not a layer of the {num_layers}-layer target")
        if i + 1 == num_layers:
            raise ValueError(
                f"aux layer {i} is the output of the target's last layer ({num_layers} layers): llama.cpp captures "
                f"layer inputs, and id {num_layers} would select the target's nextn state, which llama targets do "
                "not produce (the server aborts or runs without speculation); train on an earlier layer")
    written = [i + 1 for i in ids]
    assert llamacpp_capture_layers(written, num_layers) == ids
    return written


def default_ids(num_layers: int) -> list[int]:
    """The converter's target_layers when the top-level ids are missing or empty (conversion/llama.py:78-81)."""
    return [2, num_layers // 2, num_layers - 3]


def wanted_ids(expected: Sequence[int] | None, num_layers: int) -> list[int] | None:
    """The ids llama.cpp must read for the trained layers (None: unknown, or no id captures them)."""
    try:
        return None if expected is None else llamacpp_layer_ids(expected, num_layers)
    except ValueError:
        return None
