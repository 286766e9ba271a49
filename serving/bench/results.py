"""What an online benchmark measured: per request, per (config, concurrency) level, and break-even.

Owns the numbers, not the HTTP (serving/bench/online.py sends the requests): tokens and times per
request as the client saw them and as the server reported them, their sums and quantiles per
level, the throughput ratio against the baseline, and the acceptance length a speculative config
needs to beat it. Promises: acceptance is completion_tokens / spec_verify_ct (target forwards after
the prefill; the prefill's token counts in completion_tokens), reported token-weighted (sum / sum)
and as a per-request mean under names that say which; a speculative level without verify counts
never gets an acceptance of 1.0 (it is an error where break-even needs one).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


class BenchmarkError(RuntimeError):
    """A request failed or a server answered something the benchmark cannot measure."""


class SpecMetricsMissing(BenchmarkError):
    """A config declared speculative returned no speculation counters (SGLang's `spec_verify_ct`,
    llama.cpp's `timings.draft_n`): the server did not speculate."""


class BaselineSpeculates(BenchmarkError):
    """A config declared as the baseline (no speculation) returned speculation counters."""


@dataclass(frozen=True)
class RequestMetrics:
    """One measured request, as the client saw it (times) and as the server reported it (tokens)."""

    config: str
    concurrency: int
    prompt_index: int
    completion_tokens: int
    ttft_s: float | None  # send -> first event carrying a token
    latency_s: float  # send -> end of the stream
    spec_verify_ct: int | None
    spec_accept_rate: float | None  # as the server reported it (None where it did not)
    finish_reason: str | None
    tokens_source: Literal["meta_info", "usage", "stream_chunks", "timings"]
    # llama.cpp and vLLM: draft tokens proposed and accepted (the server's own counters; 0 where it drafted none)
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    # the generated token ids as streamed (llama.cpp /completion with return_tokens; vLLM return_token_ids),
    # for lossless checks
    output_ids: tuple[int, ...] | None = field(default=None, repr=False)
    # vLLM: verify rounds that had drafts, by the number of drafts accepted (index j = j accepted)
    acceptance_histogram: tuple[int, ...] | None = None

    @property
    def accept_length(self) -> float | None:
        if not self.spec_verify_ct:
            return None
        return self.completion_tokens / self.spec_verify_ct

    def to_row(self) -> dict[str, Any]:
        return {"config": self.config, "concurrency": self.concurrency, "prompt_index": self.prompt_index,
                "completion_tokens": self.completion_tokens, "ttft_ms": _ms(self.ttft_s),
                "latency_ms": _ms(self.latency_s), "spec_verify_ct": self.spec_verify_ct,
                "accept_length": rounded(self.accept_length), "draft_n": self.draft_n,
                "draft_n_accepted": self.draft_n_accepted, "finish_reason": self.finish_reason,
                "tokens_source": self.tokens_source}


@dataclass(frozen=True)
class LevelResult:
    """All requests of one config at one concurrency level, and what they add up to."""

    config: str
    speculative: bool
    concurrency: int
    wall_s: float  # first send -> last stream end
    requests: tuple[RequestMetrics, ...]

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.requests)

    @property
    def output_tok_s(self) -> float:
        """Aggregate output tokens per second of wall clock, all streams together."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def ttft_quantile(self, q: float) -> float | None:
        return _quantile([r.ttft_s for r in self.requests if r.ttft_s is not None], q)

    def latency_quantile(self, q: float) -> float | None:
        return _quantile([r.latency_s for r in self.requests], q)

    @property
    def latency_mean_s(self) -> float | None:
        return statistics.fmean(r.latency_s for r in self.requests) if self.requests else None

    @property
    def spec_verify_ct(self) -> int | None:
        if not self.speculative:
            return None
        return sum(r.spec_verify_ct or 0 for r in self.requests)

    @property
    def accept_length_token_weighted(self) -> float | None:
        """sum(completion_tokens) / sum(spec_verify_ct) over all requests: what the server's log reports."""
        verify = self.spec_verify_ct
        return self.completion_tokens / verify if verify else None

    @property
    def accept_length_request_mean(self) -> float | None:
        """The mean of each request's completion_tokens / spec_verify_ct: short requests weigh as much as long ones."""
        per_request = [r.accept_length for r in self.requests if r.accept_length is not None]
        return statistics.fmean(per_request) if per_request else None

    @property
    def spec_accept_rate_mean(self) -> float | None:
        rates = [r.spec_accept_rate for r in self.requests if r.spec_accept_rate is not None]
        return statistics.fmean(rates) if rates else None

    @property
    def draft_n(self) -> int | None:
        """Draft tokens proposed, all requests (llama.cpp's counters; None where the server has none)."""
        counts = [r.draft_n for r in self.requests if r.draft_n is not None]
        return sum(counts) if counts else None

    @property
    def draft_n_accepted(self) -> int | None:
        counts = [r.draft_n_accepted for r in self.requests if r.draft_n_accepted is not None]
        return sum(counts) if counts else None

    @property
    def draft_accept_rate(self) -> float | None:
        """Accepted / proposed draft tokens, token-weighted: a share of drafts, not an acceptance length."""
        drafted, accepted = self.draft_n, self.draft_n_accepted
        return accepted / drafted if drafted and accepted is not None else None

    @property
    def position_accept_rate(self) -> list[float] | None:
        """Per draft position i (0-based): the share of drafted verify rounds that accepted position i, all
        requests together (from the server's acceptance histograms; None where the server gives none)."""
        hists = [r.acceptance_histogram for r in self.requests if r.acceptance_histogram is not None]
        if not hists:
            return None
        width = max(len(h) for h in hists)
        total = [sum(h[j] for h in hists if j < len(h)) for j in range(width)]
        rounds = sum(total)
        if not rounds:
            return None
        return [sum(total[j] for j in range(i + 1, width)) / rounds for i in range(width - 1)]

    @property
    def time_per_verify_round_s(self) -> float | None:
        """One stream's wall time per verify round: sum(latency) / sum(spec_verify_ct), prefill included."""
        verify = self.spec_verify_ct
        return sum(r.latency_s for r in self.requests) / verify if verify else None

    @property
    def time_per_token_s(self) -> float | None:
        """One stream's wall time per output token: sum(latency) / sum(completion_tokens)."""
        tokens = self.completion_tokens
        return sum(r.latency_s for r in self.requests) / tokens if tokens else None

    def to_row(self) -> dict[str, Any]:
        return {"config": self.config, "speculative": self.speculative, "concurrency": self.concurrency,
                "requests": len(self.requests), "completion_tokens": self.completion_tokens,
                "wall_s": round(self.wall_s, 3), "output_tok_s": round(self.output_tok_s, 2),
                "ttft_p50_ms": _ms(self.ttft_quantile(0.5)), "ttft_p90_ms": _ms(self.ttft_quantile(0.9)),
                "latency_mean_ms": _ms(self.latency_mean_s), "latency_p50_ms": _ms(self.latency_quantile(0.5)),
                "latency_p90_ms": _ms(self.latency_quantile(0.9)), "spec_verify_ct": self.spec_verify_ct,
                "accept_len_token_weighted": rounded(self.accept_length_token_weighted),
                "accept_len_request_mean": rounded(self.accept_length_request_mean),
                "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
                "draft_accept_rate": rounded(self.draft_accept_rate),
                "accept_rate_by_position": rounded_all(self.position_accept_rate)}

    def to_rows(self) -> list[dict[str, Any]]:
        """One row per request."""
        return [r.to_row() for r in self.requests]


@dataclass(frozen=True)
class BreakEven:
    """Whether one speculative config beats the baseline at one concurrency, and what it would take."""

    config: str
    concurrency: int
    baseline_tok_s: float
    spec_tok_s: float
    baseline_time_per_token_s: float  # per stream: concurrency / baseline_tok_s
    time_per_verify_round_s: float  # per stream, measured on the speculative run
    measured_accept_length: float  # token-weighted
    needed_accept_length: float  # time per verify round / baseline time per token
    predicted_speedup: float  # measured / needed
    speedup: float  # spec_tok_s / baseline_tok_s, measured

    @property
    def beats_baseline(self) -> bool:
        return self.measured_accept_length > self.needed_accept_length

    def to_row(self) -> dict[str, Any]:
        return {"config": self.config, "concurrency": self.concurrency,
                "baseline_tok_s": round(self.baseline_tok_s, 2), "spec_tok_s": round(self.spec_tok_s, 2),
                "baseline_ms_per_token": _ms(self.baseline_time_per_token_s),
                "ms_per_verify_round": _ms(self.time_per_verify_round_s),
                "accept_len_measured_token_weighted": rounded(self.measured_accept_length),
                "accept_len_needed": rounded(self.needed_accept_length),
                "predicted_speedup": rounded(self.predicted_speedup), "speedup": rounded(self.speedup),
                "beats_baseline": self.beats_baseline}


@dataclass(frozen=True)
class BreakEvenReport:
    items: tuple[BreakEven, ...]

    def to_rows(self) -> list[dict[str, Any]]:
        return [b.to_row() for b in self.items]


@dataclass(frozen=True)
class OnlineBenchResult:
    """Every (config, concurrency) level of one or more benchmark runs."""

    levels: tuple[LevelResult, ...]
    max_new_tokens: int

    @classmethod
    def combine(cls, results: Iterable[OnlineBenchResult]) -> OnlineBenchResult:
        """Runs of one config each (a production node serves one config at a time) as one result."""
        results = list(results)
        if len({r.max_new_tokens for r in results}) > 1:
            raise ValueError("results measured with different max_new_tokens do not compare")
        return cls(tuple(lv for r in results for lv in r.levels), results[0].max_new_tokens if results else 0)

    @property
    def configs(self) -> list[str]:
        return list(dict.fromkeys(lv.config for lv in self.levels))

    def level(self, config: str, concurrency: int) -> LevelResult:
        for lv in self.levels:
            if lv.config == config and lv.concurrency == concurrency:
                return lv
        raise KeyError(f"no level for config {config!r} at concurrency {concurrency}")

    def baseline_label(self, label: str | None = None) -> str | None:
        """The baseline config: `label` if given, else the only non-speculative config (None if none or several)."""
        if label is not None:
            return label
        baselines = list(dict.fromkeys(lv.config for lv in self.levels if not lv.speculative))
        return baselines[0] if len(baselines) == 1 else None

    def to_rows(self, baseline: str | None = None) -> list[dict[str, Any]]:
        """One row per level, with the throughput ratio against the baseline at the same concurrency."""
        base = self.baseline_label(baseline)
        base_tok_s = {lv.concurrency: lv.output_tok_s for lv in self.levels if lv.config == base}
        rows = []
        for lv in self.levels:
            row = lv.to_row()
            ref = base_tok_s.get(lv.concurrency)
            row["speedup_vs_baseline"] = round(lv.output_tok_s / ref, 3) if ref else None
            rows.append(row)
        return rows

    def break_even(self, baseline: str | None = None) -> BreakEvenReport:
        base = self.baseline_label(baseline)
        if base is None:
            raise ValueError("break-even needs one baseline: name it (several or no non-speculative configs)")
        base_tok_s = {lv.concurrency: lv.output_tok_s for lv in self.levels if lv.config == base}
        spec = [lv for lv in self.levels if lv.speculative and lv.concurrency in base_tok_s]
        return break_even(base_tok_s, spec)


def needed_accept_length(time_per_verify_round_s: float, baseline_tok_s: float, concurrency: int) -> float:
    """The acceptance length a speculative stream needs to match the baseline: the time of one verify round over
    the baseline's time per token (c streams at once: c / baseline_tok_s each)."""
    return time_per_verify_round_s / (concurrency / baseline_tok_s)


def break_even(baseline_tok_s: float | Mapping[int, float], spec_levels: Iterable[LevelResult]) -> BreakEvenReport:
    """The acceptance length each speculative level needs to beat the baseline, from its measured step cost.

    `baseline_tok_s` is the baseline's aggregate tokens/s at the same concurrency (one number for all
    levels, or one per concurrency). With c streams at once, one baseline stream spends
    c / baseline_tok_s per token; one speculative stream spends latency / spec_verify_ct per verify
    round and gets `acceptance length` tokens from it. So the needed acceptance length is
    (time per verify round) / (baseline time per token), and measured / needed is the predicted
    speedup; the measured speedup is the ratio of aggregate tokens/s.
    """
    items = []
    for lv in spec_levels:
        ref = baseline_tok_s if isinstance(baseline_tok_s, (int, float)) else baseline_tok_s.get(lv.concurrency)
        if not ref or ref <= 0:
            raise ValueError(f"no baseline tokens/s for concurrency {lv.concurrency} (config {lv.config!r})")
        round_s, measured = lv.time_per_verify_round_s, lv.accept_length_token_weighted
        if round_s is None or measured is None:
            raise SpecMetricsMissing(f"config {lv.config!r} at concurrency {lv.concurrency} has no spec_verify_ct: "
                                     "break-even needs a speculative run")
        per_token = lv.concurrency / ref
        needed = needed_accept_length(round_s, ref, lv.concurrency)
        items.append(BreakEven(config=lv.config, concurrency=lv.concurrency, baseline_tok_s=float(ref),
                               spec_tok_s=lv.output_tok_s, baseline_time_per_token_s=per_token,
                               time_per_verify_round_s=round_s, measured_accept_length=measured,
                               needed_accept_length=needed, predicted_speedup=measured / needed,
                               speedup=lv.output_tok_s / ref))
    return BreakEvenReport(tuple(items))


# ---------------------------------------------------------------- helpers

def _quantile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def rounded(x: float | None, digits: int = 3) -> float | None:
    """`x` rounded for a summary row; None stays None."""
    return None if x is None else round(x, digits)


def rounded_all(xs: Sequence[float] | None, digits: int = 3) -> list[float] | None:
    """Each of `xs` rounded for a summary row; None stays None."""
    return None if xs is None else [round(x, digits) for x in xs]
