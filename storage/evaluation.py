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

    def acceptance_curve(self) -> list[dict]:
        """Every point of the view `acceptance_curve`, each training run in cumulative order."""
        if not self.path.exists():
            return []
        with self.read() as con:
            res = con.execute("SELECT * FROM acceptance_curve ORDER BY run_name, training_tokens NULLS FIRST, "
                              "training_conversations NULLS FIRST, step, config_label, domain, drafter")
            cols = [d[0] for d in res.description]
            return [dict(zip(cols, r)) for r in res.fetchall()]

    def acceptance_latest(self) -> list[dict]:
        """The curve's latest point: every drafter's row of the newest measured EAGLE-3 point, on the
        held-out chat domain when it was measured, else on all domains together."""
        if not self.path.exists():
            return []
        with self.read() as con:
            res = con.execute(
                "WITH newest AS (SELECT checkpoint, config_label, domain FROM acceptance_curve "
                "  WHERE drafter = 'eagle3' AND domain IN ('heldout_chat', 'all') "
                "  ORDER BY measured_at DESC, domain = 'heldout_chat' DESC LIMIT 1) "
                "SELECT a.* FROM acceptance_curve a JOIN newest n USING (checkpoint, config_label, domain) "
                "ORDER BY a.drafter")
            cols = [d[0] for d in res.description]
            return [dict(zip(cols, r)) for r in res.fetchall()]
