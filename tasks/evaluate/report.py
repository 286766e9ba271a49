"""The offline acceptance report: per request, and per drafter over all requests and per domain.

Promises (the numbers SGLang reports): `acceptance_length` = completion_tokens / verify_rounds
(meta_info's completion_tokens / spec_verify_ct), aggregated token-weighted (sum / sum) and,
labelled apart, per-request mean; `tokens_per_verify_round` = (committed drafts + bonus) / rounds
is the server log's `accept len`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tasks.evaluate.decoding import RequestResult


@dataclass(frozen=True)
class Aggregate:
    """One drafter over one domain ("all": every request)."""

    drafter: str
    domain: str
    requests: int
    completion_tokens: int
    verify_rounds: int
    acceptance_length_token_weighted: float | None  # sum(completion_tokens) / sum(verify_rounds)
    acceptance_length_request_mean: float | None    # mean of per-request acceptance lengths
    tokens_per_verify_round: float | None           # (committed drafts + bonus) / rounds: SGLang's `accept len`
    accepted_by_position: list[int]
    position_accept_rate: list[float | None]        # accepted_by_position[j] / verify_rounds


def aggregate(results: Sequence[RequestResult], drafter: str, domain: str) -> Aggregate:
    """Token-weighted and per-request-mean acceptance lengths of `results`, and acceptance by draft position."""
    tokens = sum(r.completion_tokens for r in results)
    rounds = sum(r.verify_rounds for r in results)
    per_request = [r.acceptance_length for r in results if r.acceptance_length is not None]
    k = max((len(r.accepted_by_position) for r in results), default=0)
    by_pos = [sum(r.accepted_by_position[j] for r in results if j < len(r.accepted_by_position)) for j in range(k)]
    drafts = sum(r.committed_drafts for r in results)
    return Aggregate(drafter, domain, len(results), tokens, rounds, tokens / rounds if rounds else None,
                     sum(per_request) / len(per_request) if per_request else None,
                     (drafts + rounds) / rounds if rounds else None, by_pos,
                     [c / rounds if rounds else None for c in by_pos])


@dataclass(frozen=True)
class AcceptanceReport:
    """Per-request rows, and per drafter the aggregate over all requests and per domain.

    `lossless_checked`: how many outputs were compared token for token with the target's plain
    greedy output and found equal (a difference raises instead; 0 means not checked).
    """

    k: int
    max_new_tokens: int
    drafters: list[str]
    requests: list[RequestResult]
    aggregates: list[Aggregate]
    lossless_checked: int = 0

    @classmethod
    def build(cls, k: int, max_new_tokens: int, requests: Sequence[RequestResult],
              lossless_checked: int = 0) -> AcceptanceReport:
        drafters = list(dict.fromkeys(r.drafter for r in requests))
        domains = list(dict.fromkeys(r.domain for r in requests))
        aggs: list[Aggregate] = []
        for d in drafters:
            mine = [r for r in requests if r.drafter == d]
            aggs.append(aggregate(mine, d, "all"))
            aggs += [aggregate([r for r in mine if r.domain == dom], d, dom) for dom in domains
                     if any(r.domain == dom for r in mine)]
        return cls(k, max_new_tokens, drafters, list(requests), aggs, lossless_checked)

    def get(self, drafter: str, domain: str = "all") -> Aggregate:
        for a in self.aggregates:
            if a.drafter == drafter and a.domain == domain:
                return a
        raise KeyError(f"no aggregate for drafter {drafter!r}, domain {domain!r}")

    def to_rows(self) -> list[dict[str, Any]]:
        """One flat row per (drafter, domain), for a table."""
        rows = []
        for a in self.aggregates:
            row = {key: value for key, value in asdict(a).items()
                   if key not in ("accepted_by_position", "position_accept_rate")}
            row.update({f"accept_rate_pos{j + 1}": rate for j, rate in enumerate(a.position_accept_rate)})
            rows.append(row)
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, aggregates and per-request rows (output ids included)."""
        requests = []
        for r in self.requests:
            d = asdict(r)
            d["acceptance_length"] = r.acceptance_length
            d["tokens_per_verify_round"] = r.tokens_per_verify_round
            requests.append(d)
        return {"k": self.k, "max_new_tokens": self.max_new_tokens, "drafters": self.drafters,
                "acceptance_length_definition": "completion_tokens / verify_rounds (SGLang meta_info); "
                                                "token_weighted = sum/sum, request_mean = mean of ratios",
                "aggregates": [asdict(a) for a in self.aggregates], "lossless_checked": self.lossless_checked,
                "requests": requests}

    def format_table(self) -> str:
        """Fixed-width text, one line per (drafter, domain): the name columns are as wide as the longest name."""
        dw = max([26, *(len(a.drafter) for a in self.aggregates)])
        mw = max([14, *(len(a.domain) for a in self.aggregates)])
        head = f"{'drafter':<{dw}} {'domain':<{mw}} {'req':>4} {'tokens':>7} {'rounds':>7} {'AL tok-wt':>9} " \
               f"{'AL req-mean':>11} {'tok/round':>9}  accept rate by draft position"
        lines = [head]
        for a in self.aggregates:
            lines.append(f"{a.drafter:<{dw}} {a.domain:<{mw}} {a.requests:>4} {a.completion_tokens:>7} "
                         f"{a.verify_rounds:>7} {_fmt(a.acceptance_length_token_weighted):>9} "
                         f"{_fmt(a.acceptance_length_request_mean):>11} {_fmt(a.tokens_per_verify_round):>9}  "
                         + " ".join(_fmt(r) for r in a.position_accept_rate))
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
