"""Reads of the lineage store about evaluation: the held-out chat set and the acceptance curve.

A mixin of `storage.lineage.LineageStore` (it uses the store's `read()`), beside
`storage.reports`. Promises: every method opens the file read-only and answers from the records'
`heldout` outcome and the documented view `acceptance_curve`; a store that does not exist yet has
no held-out prompt and no curve.
"""

from __future__ import annotations

import pyarrow as pa


class EvaluationReads:

    def heldout_count(self) -> int:
        """Held-out prompts in the workspace (what `discover.heldout.cap` limits)."""
        if not self.path.exists():
            return 0
        with self.read() as con:
            return con.execute("SELECT count(*) FROM records WHERE outcome = 'heldout'").fetchone()[0]

    def heldout_prompts(self) -> list[tuple[str, list[dict]]]:
        """(prompt id, messages) of every held-out prompt, in the order they were held out (a growing
        set keeps its first prompts first, so a benchmark's first N stay the same prompts)."""
        if not self.path.exists():
            return []
        with self.read() as con:
            return con.execute(
                "SELECT p.prompt_id, p.messages FROM records r JOIN prompts p USING (prompt_id) "
                "WHERE r.outcome = 'heldout' ORDER BY r.recorded_at, p.prompt_id").fetchall()

    def heldout_among(self, prompt_ids: list[str]) -> set[str]:
        """Which of these prompt ids are held out."""
        if not self.path.exists() or not prompt_ids:
            return set()
        with self.read() as con:
            con.register("ids_in", pa.table({"prompt_id": prompt_ids}))
            return {r[0] for r in con.execute(
                "SELECT DISTINCT r.prompt_id FROM records r JOIN ids_in USING (prompt_id) "
                "WHERE r.outcome = 'heldout'").fetchall()}
