"""Speculative decoding measured on a real engine started and stopped here: llama.cpp's `llama-server`, or vLLM.

Owns the serving benchmark: which servers run on an engine (the target alone; the EAGLE-3 draft at
each draft length K of a sweep, as the engine loads it: llama.cpp the GGUF export, vLLM the
speculators export; the engine's own n-gram drafting at one K), each started on its own, warmed up,
measured at every concurrency level on the same prompts (token ids rendered with the serving
template; greedy; the same max tokens) through serving/bench/online.py's API for that engine, and
stopped before the next one starts; then the lossless check, break-even, the summary rows (which
serving/bench/verdict.py reads into verdict lines, the mean over passes and the agreement with the offline
evaluator) and a two-panel plot.
Promises: one server at a time (two would share the cores and slow each other); each speculative
server really speculates (LlamaCppServer checks /slots at start, VllmSpecServer reads that vLLM
loaded the drafter, and an EAGLE-3 level in which no token was drafted is an error); with greedy
decoding a speculative server must emit the baseline's ids, which is checked and reported per config
at concurrency 1 (identical / total, the first divergence), never assumed; at concurrency N it is
reported as information only, since batching may change the engine's arithmetic; acceptance comes
from the engine's own per-request counters; no server outlives the call, and a server that dies stops
it (ServerDied, with its log).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from serving.bench.results import BreakEven, LevelResult, OnlineBenchResult, rounded, rounded_all
from serving.llamacpp.server import LlamaCppServer, Speculation
from serving.bench.online import ServerConfig, run_online_benchmark
from serving.bench.verdict import BASELINE, verdict_lines
from serving.process import ManagedServer
from serving.vllm.extract_server import VllmEngineArgs
from serving.vllm.server import VllmSpecServer, VllmSpeculation

NgramType = Literal["ngram-simple", "ngram-mod"]
EngineName = Literal["llamacpp", "vllm"]


@dataclass(frozen=True)
class EngineConfig:
    """One server to start: the target alone (`speculation` None) or one speculative setting of its engine."""

    label: str
    speculation: Speculation | VllmSpeculation | None = None

    @property
    def drafter(self) -> str:
        """"baseline", "eagle3", or the n-gram type ("ngram" for vLLM's)."""
        s = self.speculation
        if s is None:
            return BASELINE
        if isinstance(s, VllmSpeculation):
            return s.method
        return "eagle3" if s.spec_type == "draft-eagle3" else s.spec_type

    @property
    def k(self) -> int | None:
        """Draft tokens per verify round at most (the chain depth)."""
        s = self.speculation
        if s is None:
            return None
        return s.num_speculative_tokens if isinstance(s, VllmSpeculation) else s.n_max


def engine_configs(draft_gguf: Path | None, draft_tokens: Sequence[int], ngram: NgramType | None = "ngram-simple",
                   ngram_k: int = 3) -> list[EngineConfig]:
    """The baseline, the EAGLE-3 draft at each K, then n-gram drafting at `ngram_k` (None: none)."""
    _check_sweep(draft_gguf, draft_tokens, "the draft GGUF")
    specs = [Speculation("draft-eagle3", draft_gguf, n_max=int(k)) for k in draft_tokens]
    if ngram is not None:
        specs.append(Speculation(ngram, n_max=ngram_k))
    return [EngineConfig(BASELINE)] + [EngineConfig(s.label, s) for s in specs]


def _check_sweep(draft: Path | None, draft_tokens: Sequence[int], what: str) -> None:
    if draft_tokens and draft is None:
        raise ValueError(f"an EAGLE-3 sweep (draft_tokens) needs {what}")
    if len(set(draft_tokens)) != len(draft_tokens):
        raise ValueError(f"draft_tokens lists a K twice: {list(draft_tokens)}")


def vllm_engine_configs(draft: Path | None, draft_tokens: Sequence[int], ngram: bool = True, ngram_k: int = 3,
                        prompt_lookup: tuple[int, int] = (1, 3)) -> list[EngineConfig]:
    """vLLM: the baseline, our EAGLE-3 export (speculators format) at each K, then vLLM's n-gram method at `ngram_k`."""
    _check_sweep(draft, draft_tokens, "the draft's speculators export")
    return vllm_sweep_configs({"": draft} if draft is not None else {}, draft_tokens,
                              [ngram_k] if ngram else [], [prompt_lookup])


def vllm_sweep_configs(drafts: Mapping[str, Path], draft_tokens: Sequence[int], ngram_tokens: Sequence[int],
                       prompt_lookups: Sequence[tuple[int, int]]) -> list[EngineConfig]:
    """The baseline; each named draft (its speculators export; name "" for a lone draft) at each K; vLLM's n-gram
    at each K and each prompt-lookup window (shortest:longest suffix matched). Labels are unique."""
    specs = [VllmSpeculation("eagle3", int(k), path, name=name) for name, path in drafts.items() for k in draft_tokens]
    specs += [VllmSpeculation("ngram", int(k), prompt_lookup_min=lo, prompt_lookup_max=hi)
              for lo, hi in prompt_lookups for k in ngram_tokens]
    configs = [EngineConfig(BASELINE)] + [EngineConfig(s.label, s) for s in specs]
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"the sweep names a config twice: {labels}")
    return configs


# ---------------------------------------------------------------- the engines


@dataclass(frozen=True)
class LlamaCppEngine:
    """llama.cpp's llama-server on the target GGUF; the draft is its GGUF export."""

    target_gguf: Path
    parallel: int = 2
    n_threads: int | None = None
    n_ctx: int = 2048
    name: EngineName = "llamacpp"
    api: str = "llamacpp"

    @property
    def slots(self) -> int:
        return self.parallel

    def configs(self, draft: Path | None, draft_tokens: Sequence[int], ngram: NgramType | None,
                ngram_k: int) -> list[EngineConfig]:
        return engine_configs(draft, draft_tokens, ngram, ngram_k)

    def server(self, ec: EngineConfig, log: Path | None) -> LlamaCppServer:
        return LlamaCppServer(self.target_gguf, n_ctx=self.n_ctx, n_threads=self.n_threads, parallel=self.parallel,
                              speculation=ec.speculation, log_path=log)

    @staticmethod
    def build(server: ManagedServer) -> str | None:
        return server.build_info  # type: ignore[attr-defined]


@dataclass(frozen=True)
class VllmEngine:
    """vLLM (its own environment) on the target's transformers folder; the draft is its speculators export."""

    args: VllmEngineArgs
    startup_timeout_s: float = 900.0
    prompt_lookup: tuple[int, int] = (1, 3)  # n-gram: shortest and longest context suffix matched
    name: EngineName = "vllm"
    api: str = "vllm"

    @property
    def slots(self) -> int:
        return self.args.max_num_seqs

    def configs(self, draft: Path | None, draft_tokens: Sequence[int], ngram: NgramType | bool | None,
                ngram_k: int) -> list[EngineConfig]:
        return vllm_engine_configs(draft, draft_tokens, bool(ngram), ngram_k, self.prompt_lookup)

    def server(self, ec: EngineConfig, log: Path | None) -> VllmSpecServer:
        return VllmSpecServer(self.args, speculation=ec.speculation, log_path=log,  # type: ignore[arg-type]
                              startup_timeout_s=self.startup_timeout_s)

    @staticmethod
    def build(server: ManagedServer) -> str | None:
        version = server.version  # type: ignore[attr-defined]
        return None if version is None else f"vllm-{version}"


ServingEngine = LlamaCppEngine | VllmEngine


# ---------------------------------------------------------------- lossless


@dataclass(frozen=True)
class LosslessCheck:
    """One config's output ids at one concurrency against the baseline's at concurrency 1, prompt by prompt."""

    config: str
    concurrency: int
    identical: int
    total: int
    first_divergence: str | None = None  # "prompt 3, new token 17: 1234 instead of 567"

    @property
    def passed(self) -> bool:
        return self.identical == self.total

    def summary(self) -> str:
        text = f"{self.identical}/{self.total}"
        return text if self.first_divergence is None else f"{text} (first divergence: {self.first_divergence})"


def compare_outputs(level: LevelResult, reference: LevelResult) -> LosslessCheck:
    """Count the prompts whose streamed ids (and token count) equal the reference's; name the first that differs."""
    want = {r.prompt_index: r for r in reference.requests}
    identical, first = 0, None
    for r in level.requests:
        ref = want.get(r.prompt_index)
        if ref is None or r.output_ids is None or ref.output_ids is None:
            raise ValueError(f"config {level.config!r}: no output ids to compare for prompt {r.prompt_index} "
                             "(the lossless check needs llama.cpp's /completion with return_tokens)")
        pos = _first_difference(r.output_ids, ref.output_ids)
        if pos is None and r.completion_tokens == ref.completion_tokens:
            identical += 1
        elif first is None:
            if pos is None:
                first = (f"prompt {r.prompt_index}: {r.completion_tokens} tokens generated instead of "
                         f"{ref.completion_tokens}")
            else:
                got = r.output_ids[pos] if pos < len(r.output_ids) else "the end"
                exp = ref.output_ids[pos] if pos < len(ref.output_ids) else "the end"
                first = f"prompt {r.prompt_index}, new token {pos}: {got} instead of {exp}"
    return LosslessCheck(level.config, level.concurrency, identical, len(level.requests), first)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------- the result


@dataclass(frozen=True)
class ConfigReport:
    """What one server was and how its outputs compare with the baseline's."""

    label: str
    drafter: str
    k: int | None
    server_build: str | None  # llama.cpp's build_info, e.g. "b1-0c1e570"; "vllm-0.32.0"
    startup_s: float | None
    lossless: LosslessCheck | None = None  # concurrency 1 against the baseline at 1 (None: the baseline)
    batched: tuple[LosslessCheck, ...] = ()  # every other concurrency against the baseline at 1: information


@dataclass(frozen=True)
class EngineBenchResult:
    """Every server of one embedded benchmark: the measured levels and, per config, its report."""

    result: OnlineBenchResult
    configs: tuple[ConfigReport, ...]
    parallel: int
    concurrency: tuple[int, ...]
    baseline: str = BASELINE
    # the baseline measured again at concurrency 1 after every other server: its tok/s and whether its ids
    # equal the first run's (None: not rechecked). A machine whose speed changed meanwhile shows here.
    recheck_tok_s: float | None = None
    recheck_identical: bool | None = None
    engine: EngineName = "llamacpp"

    def report(self, label: str) -> ConfigReport:
        for c in self.configs:
            if c.label == label:
                return c
        raise KeyError(f"no config {label!r}")

    def break_even(self) -> dict[tuple[str, int], BreakEven]:
        return {(b.config, b.concurrency): b for b in self.result.break_even(self.baseline).items}

    def lossless_at(self, label: str, concurrency: int) -> LosslessCheck | None:
        rep = self.report(label)
        if concurrency == 1:
            return rep.lossless
        return next((c for c in rep.batched if c.concurrency == concurrency), None)

    def rows(self) -> list[dict[str, Any]]:
        """One row per (config, concurrency): speed, TTFT, acceptance, draft counters, lossless, break-even."""
        be = self.break_even()
        base = {lv.concurrency: lv.output_tok_s for lv in self.result.levels if lv.config == self.baseline}
        out = []
        for lv in self.result.levels:
            rep, b = self.report(lv.config), be.get((lv.config, lv.concurrency))
            check = self.lossless_at(lv.config, lv.concurrency)
            ref = base.get(lv.concurrency)
            out.append({
                "engine": self.engine, "config": lv.config, "drafter": rep.drafter, "k": rep.k, "concurrency": lv.concurrency,
                "requests": len(lv.requests), "completion_tokens": lv.completion_tokens,
                "output_tok_s": round(lv.output_tok_s, 2),
                "speedup_vs_baseline": round(lv.output_tok_s / ref, 3) if ref else None,
                "ttft_p50_ms": _ms(lv.ttft_quantile(0.5)), "ttft_p90_ms": _ms(lv.ttft_quantile(0.9)),
                "latency_p50_ms": _ms(lv.latency_quantile(0.5)), "wall_s": round(lv.wall_s, 3),
                "verify_rounds": lv.spec_verify_ct, "acceptance": rounded(lv.accept_length_token_weighted),
                "acceptance_request_mean": rounded(lv.accept_length_request_mean),
                "draft_n": lv.draft_n, "draft_n_accepted": lv.draft_n_accepted,
                "draft_accept_rate": rounded(lv.draft_accept_rate),
                "accept_rate_by_position": rounded_all(lv.position_accept_rate),
                "lossless": None if check is None else check.summary(),
                "lossless_identical": None if check is None else check.identical,
                "lossless_total": None if check is None else check.total,
                "lossless_informational": lv.concurrency != 1,
                "accept_needed": rounded(b.needed_accept_length) if b else None,
                "predicted_speedup": rounded(b.predicted_speedup) if b else None,
                "ms_per_verify_round": _ms(b.time_per_verify_round_s) if b else None,
                "server_build": rep.server_build, "max_new_tokens": self.result.max_new_tokens})
            if lv.config == self.baseline and lv.concurrency == 1 and self.recheck_tok_s is not None:
                out[-1].update(baseline_recheck_tok_s=round(self.recheck_tok_s, 2),
                               baseline_recheck_identical=self.recheck_identical)
        return out

    def verdict(self) -> list[str]:
        """Plain lines: break-even of the EAGLE-3 configs, faster or slower than the baseline, n-gram, lossless."""
        return verdict_lines(self.rows())


def pass_order(configs: Sequence[EngineConfig], pass_index: int) -> list[EngineConfig]:
    """The configs in the order pass `pass_index` (from 0) runs them: the baseline first (every other is compared with
    it), the rest as given on even passes and reversed on odd ones, so that over two passes a steady drift of the
    machine's speed weighs every config alike instead of favouring the first ones."""
    head, rest = list(configs[:1]), list(configs[1:])
    return head + (rest[::-1] if pass_index % 2 else rest)


# ---------------------------------------------------------------- running it


def run_engine_benchmark(engine: ServingEngine, prompts: Sequence[Sequence[int] | str], *, draft: Path | None = None,
                         draft_tokens: Sequence[int] = (1, 2, 3), ngram: NgramType | bool | None = "ngram-simple",
                         ngram_k: int = 3, concurrency: Sequence[int] | None = None, max_new_tokens: int = 64,
                         warmup: int = 1, log_dir: Path | None = None, timeout_s: float = 600.0,
                         recheck_baseline: bool = True, configs: Sequence[EngineConfig] | None = None,
                         on_config: Callable[[ConfigReport, OnlineBenchResult], None] | None = None,
                         check_server: Callable[[EngineConfig, ManagedServer], None] | None = None) -> EngineBenchResult:
    """Start each of `engine`'s servers in turn, measure it at every concurrency, stop it; compare.

    `draft` is the draft as this engine loads it (llama.cpp: the GGUF; vLLM: the speculators folder);
    `ngram` the engine's n-gram drafter (llama.cpp: its type; vLLM: any true value), None for none.
    `prompts` are token ids (rendered with the serving chat template; sent verbatim) or rendered
    text. `concurrency` defaults to 1 and the engine's parallel slots. Servers run one after
    another, so a machine that gets busier or quieter meanwhile skews every ratio: with
    `recheck_baseline` the baseline runs again at concurrency 1 at the end, and the verdict warns
    when the two runs differ by more than DRIFT_TOLERANCE. `on_config` is called after each server
    with its report (lossless not yet filled in) and levels, e.g. to log progress. `configs` (the baseline
    first) replaces the engine's own sweep, e.g. `vllm_sweep_configs` for several drafts and n-gram windows.
    """
    if not prompts:
        raise ValueError("the serving benchmark needs at least one prompt")
    parallel = engine.slots
    levels = tuple(dict.fromkeys(concurrency if concurrency else (1, parallel)))
    if 1 not in levels:
        raise ValueError(f"concurrency {list(levels)}: the lossless check needs concurrency 1")
    configs = list(configs) if configs is not None else engine.configs(draft, draft_tokens, ngram, ngram_k)
    if not configs or configs[0].speculation is not None:
        raise ValueError("the configs start with the baseline (the target alone): every other is compared with it")
    results: list[OnlineBenchResult] = []
    reports: list[ConfigReport] = []

    def measure(ec: EngineConfig, at: tuple[int, ...], log_name: str) -> tuple[ConfigReport, OnlineBenchResult]:
        log = Path(log_dir) / f"{engine.name}-{log_name}.log" if log_dir is not None else None
        with engine.server(ec, log) as server:
            if check_server is not None:
                check_server(ec, server)
            cfg = ServerConfig(ec.label, speculative=ec.speculation is not None, url=server.base_url, api=engine.api,
                               num_draft_tokens=ec.k, expect_drafts=ec.drafter == "eagle3")
            res = asyncio.run(server.guard(run_online_benchmark(None, prompts, [cfg], at, max_new_tokens,
                                                                warmup=warmup, timeout_s=timeout_s)))
            return ConfigReport(ec.label, ec.drafter, ec.k, engine.build(server), server.startup_s), res

    for ec in configs:
        rep, res = measure(ec, levels, ec.label)
        results.append(res)
        reports.append(rep)
        if on_config is not None:
            on_config(rep, res)
    combined = OnlineBenchResult.combine(results)
    recheck_tok_s = recheck_identical = None
    if recheck_baseline and len(configs) > 1:
        rep, again = measure(configs[0], (1,), f"{BASELINE}-again")
        if on_config is not None:
            on_config(ConfigReport(f"{BASELINE} (again)", rep.drafter, rep.k, rep.server_build, rep.startup_s), again)
        recheck_tok_s = again.levels[0].output_tok_s
        recheck_identical = compare_outputs(again.levels[0], combined.level(BASELINE, 1)).passed
    reference = combined.level(BASELINE, 1)
    final = []
    for rep in reports:
        mine = [lv for lv in combined.levels if lv.config == rep.label]
        single = next(lv for lv in mine if lv.concurrency == 1)
        batched = tuple(compare_outputs(lv, reference) for lv in mine if lv.concurrency != 1)
        lossless = None if rep.label == BASELINE else compare_outputs(single, reference)
        final.append(ConfigReport(rep.label, rep.drafter, rep.k, rep.server_build, rep.startup_s, lossless, batched))
    return EngineBenchResult(combined, tuple(final), parallel, levels, BASELINE, recheck_tok_s, recheck_identical,
                             engine.name)


# ---------------------------------------------------------------- plot


def plot_engine_benchmark(rows: Sequence[Mapping[str, Any]], path: str | Path, *,
                          offline: Mapping[int, float] | None = None, title: str = "llama-server") -> Path:
    """Two panels: output tok/s by config at each concurrency (the baseline's level dashed), and acceptance
    length by config (with the offline evaluator's, where given per k, as a marker)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    configs = list(dict.fromkeys(r["config"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["config"], r["concurrency"]): r for r in rows}
    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)  # no pyplot: no global backend, safe in workers and threads
    speed, accept = fig.subplots(1, 2)
    width = 0.8 / max(len(levels), 1)
    colours = ["C0", "C1", "C2", "C3", "C4", "C5"]
    for j, c in enumerate(levels):
        xs = [i + (j - (len(levels) - 1) / 2) * width for i in range(len(configs))]
        ys = [(by.get((cfg, c)) or {}).get("output_tok_s") or 0.0 for cfg in configs]
        colour = colours[j % len(colours)]
        speed.bar(xs, ys, width * 0.95, color=colour, label=f"concurrency {c}")
        base = by.get((BASELINE, c))
        if base is not None:
            speed.axhline(base["output_tok_s"], color=colour, linestyle="--", linewidth=1)
        for x, y, cfg in zip(xs, ys, configs):
            s = (by.get((cfg, c)) or {}).get("speedup_vs_baseline")
            if s is not None and cfg != BASELINE:
                speed.annotate(f"{s:.2f}x", (x, y), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
    speed.set_xticks(range(len(configs)), configs, rotation=20, fontsize=8)
    speed.set_ylabel("output tokens/s (all streams)")
    speed.set_title("throughput (dashed: baseline)")
    speed.legend(fontsize=8, loc="lower right")  # above the bars it hides their ratio labels
    speed.grid(axis="y", alpha=0.3)

    spec = [cfg for cfg in configs if cfg != BASELINE]
    for j, c in enumerate(levels):
        xs = [i + (j - (len(levels) - 1) / 2) * width for i in range(len(spec))]
        ys = [(by.get((cfg, c)) or {}).get("acceptance") or 0.0 for cfg in spec]
        accept.bar(xs, ys, width * 0.95, color=colours[j % len(colours)], label=f"concurrency {c}")
    if offline:
        points = [(i, offline[by[(cfg, 1)]["k"]]) for i, cfg in enumerate(spec)
                  if (cfg, 1) in by and by[(cfg, 1)]["drafter"] == "eagle3" and by[(cfg, 1)]["k"] in offline]
        if points:
            accept.plot([p[0] for p in points], [p[1] for p in points], "k*", markersize=10, label="offline evaluator")
    accept.axhline(1.0, color="grey", linewidth=1)
    accept.set_xticks(range(len(spec)), spec, rotation=20, fontsize=8)
    accept.set_ylabel("acceptance length (tokens / target forward)")
    accept.set_title("acceptance (token-weighted)")
    accept.set_ylim(bottom=0)
    accept.legend(fontsize=8)
    accept.grid(axis="y", alpha=0.3)
    max_new = rows[0].get("max_new_tokens") if rows else None
    fig.suptitle(f"{title}: greedy, max_new_tokens={max_new}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)

