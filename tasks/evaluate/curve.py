"""The acceptance curve as a picture: EAGLE-3 acceptance against what the draft was trained on.

Owns choosing what to draw from the rows of the view `acceptance_curve` (one domain, one chain
depth) and the PNG (matplotlib, Agg). Promises: the drawn domain is `heldout_chat` when any
EAGLE-3 point was measured on it, else `all`; the chain depth is the newest EAGLE-3 point's; prompt
lookup and the same draft fed only the final state are horizontal lines at their newest values (the
latter only when such a row exists); the returned `CurvePlot` says exactly what was drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tasks.evaluate.heldout import HELDOUT_DOMAIN

EAGLE3 = "eagle3"
REFERENCES = (("prompt-lookup", "prompt lookup (n-gram)"),
              ("eagle3-final-state-only", "same draft, final state only (latest)"))


@dataclass
class CurvePlot:
    path: Path
    domain: str
    config_label: str
    series: dict[str, list[tuple[int | None, int | None, float]]] = field(default_factory=dict)  # run -> points
    references: dict[str, float] = field(default_factory=dict)  # drafter -> newest acceptance length


def curve_points(rows: Sequence[dict]) -> CurvePlot | None:
    """What the PNG shows, from `acceptance_curve` rows; None when no EAGLE-3 point exists yet."""
    ours = [r for r in rows if r["drafter"] == EAGLE3 and r["acceptance_length"] is not None]
    if not ours:
        return None
    domain = HELDOUT_DOMAIN if any(r["domain"] == HELDOUT_DOMAIN for r in ours) else "all"
    newest = max((r for r in ours if r["domain"] == domain), key=lambda r: r["measured_at"])
    label = newest["config_label"]
    plot = CurvePlot(Path(), domain, label)
    for r in rows:
        if r["domain"] != domain or r["config_label"] != label or r["acceptance_length"] is None:
            continue
        if r["drafter"] == EAGLE3:
            plot.series.setdefault(r["run_name"], []).append(
                (r["training_tokens"], r["training_conversations"], r["acceptance_length"]))
    for drafter, _ in REFERENCES:
        theirs = [r for r in rows if r["drafter"] == drafter and r["domain"] == domain and r["config_label"] == label
                  and r["acceptance_length"] is not None]
        if theirs:
            plot.references[drafter] = max(theirs, key=lambda r: r["measured_at"])["acceptance_length"]
    return plot


def acceptance_curve_png(rows: Sequence[dict], path: Path) -> CurvePlot | None:
    """Write the curve (vs training tokens, and vs training conversations) to `path`; None if there is no point."""
    plot = curve_points(rows)
    if plot is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x_of, xlabel in ((axes[0], 0, "training tokens (loss-masked, cumulative)"),
                             (axes[1], 1, "training conversations (cumulative)")):
        for run, pts in plot.series.items():
            xy = [(p[x_of], p[2]) for p in pts if p[x_of] is not None]
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=f"EAGLE-3 ({run})")
        for (drafter, name), style in zip(REFERENCES, ("--", ":")):
            if drafter in plot.references:
                v = plot.references[drafter]
                ax.axhline(v, linestyle=style, color="gray" if style == "--" else "tab:red",
                           label=f"{name}: {v:.2f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("acceptance length (token-weighted)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"acceptance on {plot.domain}, {plot.config_label}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    plot.path = path
    return plot
