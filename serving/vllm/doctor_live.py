"""vLLM's side of the serving contract, proven by vLLM itself: start it on the draft and read what it loaded.

Owns the `live` checks of the vllm engine (`run_doctor(..., engine="vllm", live=True)`, `eagle3 doctor
--engine vllm --live`) and the comparison of what a running vLLM says it loaded (serving/vllm/server.py's
`LoadedDraft`, read from its own start-up lines) with what the draft was trained on; the serving
benchmark makes the same comparison for every EAGLE-3 server it starts. Promises: the aux layers are
the ones vLLM reports capturing, converted to the project convention (vLLM captures before layer j,
so j-1); ids shifted by one either way are named as such; the embeddings must be the target's (our
drafts save none) and the lm_head the draft's own (over the draft vocabulary); a line vLLM did not
print is a failure, never a pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from serving.doctor.core import Check, Context
from serving.vllm.server import LoadedDraft, VllmSpecServer

LIVE_CHECKS = ("vllm_loaded_aux_layers", "vllm_loaded_embeddings", "vllm_loaded_lm_head")


def loaded_checks(loaded: LoadedDraft, expected: Sequence[int] | None, source: str | None = None) -> list[Check]:
    """What vLLM says it loaded against the trained aux layers (`expected`, project convention) and our format."""
    return [_aux_check(loaded, expected, source), _embeddings_check(loaded), _head_check(loaded)]


def _aux_check(loaded: LoadedDraft, expected: Sequence[int] | None, source: str | None) -> Check:
    name = LIVE_CHECKS[0]
    if loaded.aux_layer_ids is None:
        return Check(name, False, "vLLM's log names no auxiliary layers: it did not set up EAGLE-3's aux hidden "
                                  "states (is the method eagle3?)")
    ids = list(loaded.aux_layer_ids)
    ours = [j - 1 for j in ids]  # vLLM captures the input of layer j: the output of layer j-1
    where = "from the draft's config" if loaded.aux_from_config else "its model's DEFAULT layers (the draft's config " \
                                                                     "named none it reads)"
    said = f"vLLM captures before layers {ids} ({where}), i.e. the outputs of layers {ours}"
    if expected is None:
        return Check(name, True, f"{said}; cannot verify: nothing says which layers the draft was trained on",
                     warning=True)
    want = [int(i) for i in expected]
    trained = f"the draft was trained on the outputs of layers {want}" + (f" ({source})" if source else "")
    if ours == want and loaded.aux_from_config:
        return Check(name, True, f"{said}: the trained layers")
    if len(ours) == len(want):
        shift = {o - w for o, w in zip(ours, want)}
        if len(shift) == 1 and shift.pop() in (-1, 1):
            by = ours[0] - want[0]
            return Check(name, False, f"{said}, but {trained}: the ids are shifted by {by:+d} (written in another "
                                      f"convention). Write eagle_aux_hidden_state_layer_ids = {[i + 1 for i in want]} "
                                      "(`eagle3 doctor --engine vllm --fix`).")
    return Check(name, False, f"{said}, but {trained}. Write eagle_aux_hidden_state_layer_ids = "
                              f"{[i + 1 for i in want]} at the top level of config.json.")


def _embeddings_check(loaded: LoadedDraft) -> Check:
    return _said(LIVE_CHECKS[1], loaded.shares_target_embeddings, "whose token embeddings the draft uses",
                 "the draft shares the target's token embeddings (as trained: they were frozen)",
                 "vLLM keeps embeddings of the draft's own: the draft was trained on the target's frozen embeddings, "
                 "and this export should carry none (or the target's)")


def _head_check(loaded: LoadedDraft) -> Check:
    return _said(LIVE_CHECKS[2], loaded.own_lm_head, "whose lm_head the draft uses",
                 "the draft's own lm_head (over its draft vocabulary)",
                 "vLLM uses the TARGET's lm_head for the draft: the draft's own head (over the draft vocabulary, "
                 "mapped by d2t) was not loaded; check lm_head.weight in the export")


def _said(name: str, value: bool | None, what: str, right: str, wrong: str) -> Check:
    """A check on one thing vLLM's log says: right (True), wrong (False), or not said at all (None: a failure)."""
    if value is None:
        return Check(name, False, f"vLLM's log does not say {what}")
    return Check(name, True, right) if value else Check(name, False, wrong)


def failed_loaded_checks(server: VllmSpecServer, expected: Sequence[int] | None) -> list[Check]:
    """The live checks a started EAGLE-3 server fails (none for a server without a drafter)."""
    if server.loaded_draft is None:
        return []
    return [c for c in loaded_checks(server.loaded_draft, expected) if not c.ok]


def target_folder(target: object) -> Path | None:
    """The target's model folder, when `target` names one (a folder, or the config.json inside one)."""
    if isinstance(target, (str, Path)):
        p = Path(target).expanduser()
        if p.is_dir() and (p / "config.json").is_file():
            return p
        if p.is_file() and p.name == "config.json":
            return p.parent
    return None


def live_checks(draft: Path, target: object, ctx: Context) -> list[Check]:
    """Start vLLM on the target with this draft (eagle3, one draft token), read what it loaded, stop it."""
    from serving.process import ServerStartError
    from serving.vllm.extract_server import VllmEngineArgs
    from serving.vllm.server import VllmSpeculation

    folder = target_folder(target)
    if folder is None:
        return [Check(LIVE_CHECKS[0], False, f"the live check starts vLLM on the target: give the target's model "
                                             f"folder (not {target!r})")]
    args = VllmEngineArgs(model=folder, dtype="float32", max_model_len=512, max_num_seqs=1)
    server = VllmSpecServer(args, speculation=VllmSpeculation("eagle3", 1, draft))
    try:
        with server:
            loaded = server.loaded_draft
    except (ServerStartError, FileNotFoundError) as e:
        return [Check(LIVE_CHECKS[0], False, f"vLLM did not start on this draft: {str(e)[:2000]}")]
    assert loaded is not None
    return loaded_checks(loaded, ctx.expected, ctx.expected_source)
