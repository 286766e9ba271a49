"""SGLang's aux-layer id convention: which ids to write in `eagle_config` and which layers SGLang then captures.

Owns `sglang_capture_layers` (SGLang's capture rule, as a pure function) and `sglang_layer_ids` (the
ids to write for trained layers given in the project convention: output of decoder layer i,
0-based). Promises: SGLang changed its rule in PR #25454; ids are written so that SGLang before and
since that PR capture the trained layers, and a layer set no single list serves to both is refused
unless the SGLang version is named (docs/contracts.md, failure 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

# SGLang changed how it reads eagle_aux_hidden_state_layer_ids in PR #25454 (see sglang_capture_layers).
SGLangVersion = Literal["before-pr25454", "since-pr25454"]
SGLANG_VERSIONS: tuple[SGLangVersion, ...] = ("before-pr25454", "since-pr25454")


def sglang_capture_layers(written_ids: Sequence[int], num_layers: int, version: SGLangVersion) -> list[int | None]:
    """The layers SGLang captures for `written_ids`, in project convention (None: not a layer output).

    SGLang captures the hidden state entering layer j (the output of layer j-1). Before PR #25454
    it set j = id + 1 for every id; since, it does so only when the first id is 1 (ids starting
    at 2 are read as "captured before layer j" as they are). j = 0 would be the embeddings and
    j >= num_layers is never reached by the capture loop.
    """
    if version not in SGLANG_VERSIONS:
        raise ValueError(f"unknown SGLang version {version!r}; one of {SGLANG_VERSIONS}")
    ids = [int(i) for i in written_ids]
    shift = version == "before-pr25454" or (bool(ids) and ids[0] == 1)
    before = [i + 1 if shift else i for i in ids]
    return [j - 1 if 1 <= j < num_layers else None for j in before]


def sglang_layer_ids(aux_layer_ids: Sequence[int], num_layers: int, version: SGLangVersion | None = None) -> list[int]:
    """The ids to write in `eagle_config` so SGLang captures `aux_layer_ids` (project convention).

    With `version=None` the ids must serve both SGLang versions; that is possible exactly when the
    first layer is 1 (the EAGLE-3 default), and otherwise refused: name the version the draft
    will be served by.
    """
    ids = [int(i) for i in aux_layer_ids]
    candidates = {"before-pr25454": ids, "since-pr25454": ids if ids[:1] == [1] else [i + 1 for i in ids]}
    versions = SGLANG_VERSIONS if version is None else (version,)
    written = {tuple(candidates[v]) for v in versions}
    ok = [w for w in written if all(sglang_capture_layers(w, num_layers, v) == ids for v in versions)]
    if ok:
        return list(ok[0])
    if version is None:
        raise ValueError(
            f"aux layers {ids} cannot be written so that SGLang before and since PR #25454 both capture them: "
            f"before that PR SGLang adds 1 to every id, since then only when the first id is 1. Train with a first "
            f"aux layer of 1, or export for one version (sglang_version='before-pr25454' writes "
            f"{candidates['before-pr25454']}, "
            f"'since-pr25454' writes {candidates['since-pr25454']})")
    raise ValueError(f"SGLang {version} cannot capture aux layers {ids}: the output of layer 0 is only reachable by "
                     "writing 1 first, which that version shifts by one")
