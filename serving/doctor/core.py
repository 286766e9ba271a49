"""The doctor's shared machinery: the report, the target, the engine contract and the context of the checks.

Owns `Check`, `DoctorReport`, `TargetInfo` / `load_target_info`, `EngineContract` (what an engine's
package must say about itself), the `Context` every check shares and
`expected_aux_layer_ids_from_lineage`. The draft folder as read is serving/draft_folder.py, the
checks serving/contract.py. Promises: no engine's facts
live here (only the `Engine` names, and the SGLang versions to check, which the context carries for
the engine that needs them); what differs between engines is a field of the `EngineContract`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from serving.draft_folder import CONFIG_FILE, PROJECT_KEY, Folder, as_int, int_list
from serving.sglang.layers import SGLANG_VERSIONS, SGLangVersion

Engine = Literal["sglang", "vllm", "llamacpp"]

# Folder checks `fix=True` repairs for every engine (besides its `ids_checks`); an engine adds its own
# through `extra_repairs`.
COMMON_FIXABLE = ("weight_keys", "vocab_mapping", "use_aux_hidden_state", "tie_word_embeddings")
D2T_OFFSETS_USE = "SGLang proposes target id d2t[i] + i for draft id i, so the draft would propose wrong tokens"


# ---------------------------------------------------------------- report

@dataclass(frozen=True)
class Check:
    """One named check. `message` says what is wrong and how to fix it (or what was verified)."""

    name: str
    ok: bool
    message: str
    warning: bool = False  # passed, but could not be fully verified: the message says what is missing
    fixable: bool = False  # failed, and `fix=True` repairs it mechanically


@dataclass
class DoctorReport:
    """The checks of one draft folder for one engine.

    `passed` is about the folder (and launch command) as given; with `fix=True`, `fixed_dir` is the
    corrected copy (None when nothing could be fixed mechanically) and `fixed` its own report.
    """

    draft_dir: Path
    engine: Engine
    checks: list[Check] = field(default_factory=list)
    architecture: str | None = None
    captured_layers: dict[str, list[int | None]] | None = None  # engine (version) -> layers it captures
    draft_vocab_size: int | None = None
    target_vocab_size: int | None = None
    hidden_size: int | None = None
    fixed_dir: Path | None = None
    fixed: DoctorReport | None = None
    fixes: list[str] = field(default_factory=list)  # what the corrected copy changed
    not_fixed: list[str] = field(default_factory=list)  # why a failing check was left alone

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.ok and c.warning]

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def summary_line(self) -> str:
        """One line: PASS with engine, architecture, captured layers, draft vocab, hidden size; else FAIL and the failed names."""
        if not self.passed:
            return (f"FAIL {self.engine}: {self.draft_dir}: {len(self.failed)} failed check(s): "
                    f"{', '.join(c.name for c in self.failed)}")
        layers = "unknown"
        if self.captured_layers:
            distinct = {tuple(v) for v in self.captured_layers.values()}
            layers = str(list(next(iter(distinct)))) if len(distinct) == 1 else str(self.captured_layers)
        vocab = f"{self.draft_vocab_size}" + (f" of {self.target_vocab_size}" if self.target_vocab_size else "")
        warn = f"; {len(self.warnings)} warning(s): {', '.join(c.name for c in self.warnings)}" if self.warnings else ""
        return (f"PASS {self.engine}: {self.architecture}, captures target layers {layers} (output of layer i, "
                f"0-based), draft vocab {vocab}, hidden {self.hidden_size}{warn}")

    def failure_lines(self) -> list[str]:
        """One line per failed check: `name: what is wrong; how to fix it`."""
        return [f"{c.name}: {c.message}" for c in self.failed]

    def warning_lines(self) -> list[str]:
        return [f"{c.name} (warning): {c.message}" for c in self.warnings]


# ---------------------------------------------------------------- target and folder

@dataclass(frozen=True)
class TargetInfo:
    """What the draft must agree with: the target's text model shape."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    folder: Path | None  # the local model folder, when the target was given as a path


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # Multimodal wrappers (e.g. Kimi-K2.5) keep the language model's shape in text_config.
    text = config.get("text_config")
    if config.get("hidden_size") is None and isinstance(text, Mapping):
        return text
    return config


def load_target_info(target: str | Path | Mapping[str, Any]) -> TargetInfo:
    """The target's hidden size, vocab size and layer count from a config dict, a config.json, or a model folder."""
    folder: Path | None = None
    if isinstance(target, Mapping):
        config: Mapping[str, Any] = target
    else:
        path = Path(target).expanduser()
        if path.is_dir():
            folder, path = path.resolve(), path / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"target {target}: no config.json there; give the target model folder, its "
                                    "config.json, or the config as a dict (a hub id is not read)")
        folder = folder or path.resolve().parent
        config = json.loads(path.read_text())
    text = _text_config(config)
    missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if not isinstance(text.get(k), int)]
    if missing:
        raise ValueError(f"target config has no {', '.join(missing)}")
    return TargetInfo(int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"]), folder)


def default_capture(num_layers: int) -> list[int]:
    """What both engines capture with no ids: states entering layers [2, L//2, L-3], i.e. outputs [1, L//2-1, L-4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


# ---------------------------------------------------------------- the engine contract

def _no_misspelled_keys(keys: Sequence[str]) -> tuple[list[str], str | None]:
    return [], None


def _no_loader_skips(ctx: Context, explained: set[str]) -> str | None:
    return None


def _no_hint(ctx: Context) -> str:
    return ""


def _same_spelling(name: str) -> str:
    return name


class CheckFile(Protocol):
    def __call__(self, draft: Path, target: TargetInfo, expected: Sequence[int] | None, fix: bool,
                 fix_dir: Path | None) -> DoctorReport | None: ...


@dataclass(frozen=True)
class EngineContract:
    """What one engine reads from a draft folder and a launch command; one per engine module, registered in run.py.

    The shared checks (checks.py), the repair (fix.py) and `run_doctor` ask these fields wherever
    engines differ, so adding an engine is one module that builds one of these (and one registry line).
    """

    name: Engine
    # -- where the engine reads the draft's fields
    layer_config_key: str | None  # the block holding the draft layer's Llama fields; None: the top level
    top_level_use_aux: bool  # the engine also reads a top-level use_aux_hidden_state (not only eagle_config's)
    # -- aux layer ids: where they are written, what the engine then captures, what to write for the trained layers
    ids_location: str  # the field, as named in aux_layers' fix line
    written_ids: Callable[[Mapping[str, Any]], list[int] | None]  # config -> the ids the engine reads
    captured: Callable[[Context], dict[str, list[int | None]]]  # engine (version) -> layers (project convention)
    ids_to_write: Callable[[Context], list[int] | None]  # None: trained layers unknown or no list works
    write_ids: Callable[[Context, dict[str, Any], list[int]], str]  # writes them into a config copy; the fix line
    # -- the folder checks that are the engine's own
    check_architecture: Callable[[Context], Check]
    check_eagle_config: Callable[[Context], Check]
    unknown_keys_fate: str  # what the loader does with a key that is no draft tensor (weight_keys' message)
    # -- the launch command
    launch_usage: str  # how a command that starts this engine looks (launch_command's message)
    launch_checks: Callable[[list[str], list[str], Path, TargetInfo], list[Check]]  # (argv, engine args, draft, target)
    # -- optional: what only some engines have
    extra_checks: tuple[Callable[[Context], Check | None], ...] = ()  # reported after tie_word_embeddings
    serves_eagle31_norms: bool = False  # reads norm_before_fc / fc_norm / norm_output (speculators' top-level flags)
    extra_repairs: Mapping[str, Callable[[dict[str, Any]], str]] = field(default_factory=dict)  # check -> config fix
    unwritable_ids_hint: Callable[[Context], str] = _no_hint  # aux_layers' advice when no id list can be written
    misspelled_keys: Callable[[Sequence[str]], tuple[list[str], str | None]] = _no_misspelled_keys  # keys, problem
    loader_skips: Callable[[Context, set[str]], str | None] = _no_loader_skips  # further keys dropped silently
    spell_key: Callable[[str], str] = _same_spelling  # canonical name -> the engine's spelling (for --fix)
    rename_note: str = ""  # added to the weight_keys fix line
    ignores: frozenset[str] = frozenset()  # shared folder checks about fields this engine never reads (not reported)
    d2t_use: str = D2T_OFFSETS_USE  # what the engine does with d2t offsets (vocab_mapping's message)
    # the checks whose repair is writing the aux layer ids (fix.py writes them when any of these fails)
    ids_checks: tuple[str, ...] = ("eagle_config", "aux_layers")
    # the aux-layer checks and the captured layers, when the shared `check_aux_layers` does not say it right
    aux_checks: Callable[[Context], tuple[list[Check], dict[str, list[int | None]]]] | None = None
    # the engine's own converted draft file (llama.cpp's GGUF): its report, or None when `draft` is no such file
    check_file: CheckFile | None = None
    # start the engine on the draft and check what it says it loaded: (draft, target as given, context) -> checks
    live_checks: Callable[[Path, Any, Context], list[Check]] | None = None

    @property
    def fixable_checks(self) -> frozenset[str]:
        """The folder checks `fix=True` may repair for this engine."""
        return frozenset((*COMMON_FIXABLE, *self.ids_checks, *self.extra_repairs))


# ---------------------------------------------------------------- the context

@dataclass
class Context:
    """Everything the checks share, computed once."""

    folder: Folder
    contract: EngineContract
    target: TargetInfo
    layer: Mapping[str, Any]  # the draft layer's Llama fields (speculators: transformer_layer_config)
    hidden: int | None
    n_draft: int | None
    expected: list[int] | None
    expected_source: str | None
    expected_conflict: str | None
    versions: tuple[SGLangVersion, ...]
    record: Mapping[str, Any]

    @property
    def engine(self) -> Engine:
        return self.contract.name


def make_context(folder: Folder, contract: EngineContract, target: TargetInfo, expected: Sequence[int] | None,
                 sglang_version: SGLangVersion | None) -> Context:
    config = folder.config
    layer = config.get(contract.layer_config_key) if contract.layer_config_key else config
    if not isinstance(layer, Mapping):
        layer = config
    record = config.get(PROJECT_KEY) if isinstance(config.get(PROJECT_KEY), Mapping) else {}
    recorded = int_list(record.get("aux_layer_ids"))
    conflict = None
    if expected is not None:
        expected_list, source = [int(i) for i in expected], "from lineage / the caller"
        if recorded is not None and recorded != expected_list:
            conflict = (f"the folder's {PROJECT_KEY} record says the draft was trained on layers {recorded}, lineage / "
                        f"the caller says {expected_list}: this folder may not be the checkpoint you think")
    elif recorded is not None:
        expected_list, source = recorded, f"from the folder's {PROJECT_KEY} record"
    else:
        expected_list, source = None, None
    versions = (sglang_version,) if sglang_version else SGLANG_VERSIONS
    return Context(folder=folder, contract=contract, target=target, layer=layer,
                   hidden=as_int(layer.get("hidden_size")), n_draft=as_int(config.get("draft_vocab_size")),
                   expected=expected_list, expected_source=source, expected_conflict=conflict, versions=versions,
                   record=record)


# ---------------------------------------------------------------- lineage

def expected_aux_layer_ids_from_lineage(lineage_db_path: str | Path, draft_dir: str | Path) -> list[int] | None:
    """The aux layers the checkpoint at `draft_dir` was trained on, from the lineage store's `checkpoints` table.

    Read-only (`store.reports.query_readonly`). Paths are compared resolved (a relative stored path is
    tried against the current directory and the store's folder). None when the store does not exist
    or has no row for this folder; ValueError when rows disagree with each other or with the
    extraction settings they name (the lineage would then not say which layers are right).
    """
    from storage.lineage import LineageStore

    db = Path(lineage_db_path).expanduser()
    if not db.exists():
        return None
    _, rows = LineageStore(db).reports.query_readonly(
        "SELECT c.path, c.aux_layer_ids, e.settings FROM checkpoints c "
        "LEFT JOIN extract_settings e ON e.extract_key = c.extract_key")
    want = Path(draft_dir).expanduser().resolve()
    found: dict[tuple[int, ...], list[str]] = {}
    for path, ids, settings in rows:
        p = Path(path).expanduser()
        candidates = [p] if p.is_absolute() else [Path.cwd() / p, db.parent / p]
        if not any(c.resolve() == want for c in candidates):
            continue
        ids = [int(i) for i in ids]
        extracted = int_list((json.loads(settings) if isinstance(settings, str) else settings or {})
                             .get("aux_layer_ids")) if settings is not None else None
        if extracted is not None and extracted != ids:
            raise ValueError(f"lineage {db}: checkpoint {path} records aux layers {ids} but its extraction used "
                             f"{extracted}")
        found.setdefault(tuple(ids), []).append(str(path))
    if len(found) > 1:
        raise ValueError(f"lineage {db}: rows for {want} disagree on the aux layers: {found}")
    return list(next(iter(found))) if found else None
