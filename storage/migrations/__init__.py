"""The lineage store's DDL: one module per schema version, applied in order by `storage.connection`.

Each `vNN_<what>.py` holds `VERSION`, `DESCRIPTION` (recorded in `schema_migrations`) and `SQL`,
the tables and public views (`record_outcomes`, `progress`, `checkpoint_lineage`,
`acceptance_curve`, `prompt_clusters`, ...) that version added or changed. Promises: a shipped
migration is never edited (an existing database must see no difference); a schema change is a
new module `vNN_<what>.py` with the next version.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

# Every `vNN_*` module of this package, in file-name order (NN is zero-padded, so that is version order).
_MODULES: list[ModuleType] = [importlib.import_module(f"{__name__}.{m.name}")
                              for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
                              if m.name[:1] == "v" and m.name[1:3].isdigit()]

# (version, description, SQL) in version order: what `DuckDBFile` applies on a file's first write.
MIGRATIONS: list[tuple[int, str, str]] = [(m.VERSION, m.DESCRIPTION, m.SQL) for m in _MODULES]

# A gap or a reordering would apply a migration to a schema it was not written for.
if [v for v, _, _ in MIGRATIONS] != list(range(1, len(MIGRATIONS) + 1)) or any(
        int(m.__name__.rsplit(".", 1)[1][1:3]) != m.VERSION for m in _MODULES):
    raise RuntimeError("storage.migrations: versions must run 1..n in order, each in its file vNN_*.py")
