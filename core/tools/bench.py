"""The benchmark: TokenSwift against vanilla decoding and transformers' generate, side by side in one process.

Every method runs on the same prompts, seed and settings; the method order rotates with each prompt and repeat so
machine drift hits all alike. One generation per (method, prompt, repeat) runs to the longest length; the figures
at each shorter length are read off the same run (the time at which its L-th token appeared), which is what
"speed at length L" means for a user waiting for L tokens. Speedups are medians of ratios measured side by side.

Methods: `hf` (transformers `generate` on the same weights), `hf-lookup` (its prompt-lookup decoding,
prompt_lookup_num_tokens=10), `llama.cpp` (the same GGUF file: core/tools/peers.py), `ar` (our vanilla decoding),
`tokenswift` (the engine's settings), and variants of it that differ in one thing (VARIANTS): each draft mode
explicitly, the ablations without the n-gram table, without the heads, or without the root head, one that verifies
every draft however unlikely, one that gates drafts on their raw scores, other tree sizes and gates (the CPU
defaults on a GPU, the GPU defaults on a CPU), in either draft mode.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import torch
from tqdm import tqdm

from core.engine import Engine
from core.generation.agreement import first_divergence, format_gap
from core.generation.decoding import GenerationConfig
from core.generation.divergence import Divergence, explain_divergence
from core.generation.metrics import distinct_n
from core.generation.sampling import PRESETS
from core.generation.text import encode_prompt
from core.runtime.loading import gguf_source, resolve
from core.runtime.paths import ASSETS
from core.tokenswift.options import CPU_GATES, GAMMA
from core.tools.args import load_engine
from core.tools.hardware import hardware, run_report
from core.tools.peers import BUILD_HINT, llama_cpp_binary, run_llama_cpp
from core.tools.roofline import read_rate_now, step_reads

# TokenSwift variants: the engine's options they change (None: drop the heads; drafting from n-grams only)
VARIANTS: dict[str, dict[str, Any] | None] = {
    "tokenswift-fused": {"draft_mode": "fused"},
    "tokenswift-separate": {"draft_mode": "separate"},
    "tokenswift-no-ngram": {"ngram_topk": 0},
    "tokenswift-no-root": {"root_head": False},
    "tokenswift-no-heads": None,
    "tokenswift-always": {"min_draft_score": 0.0},
    "tokenswift-raw-gate": {"calibrate": False, "min_draft_score": 0.35},
    # the draft gates of AVX-512's and AVX2's kernels (CPU_GATES), side by side on any CPU
    "tokenswift-avx512-gate": {"min_draft_score": CPU_GATES["avx512"]},
    "tokenswift-avx2-gate": {"min_draft_score": CPU_GATES["avx2"]},
    "tokenswift-tree2": {"tree_budget": 2, "min_draft_score": 0.25},  # at most one draft a step, gated
    # the root head's first level only (the CPU defaults before the chained root head)
    "tokenswift-deep4": {"tree_budget": 4, "draft_depth": 1, "min_draft_score": 0.25},
    # the gated trees drafted by the chained root head's 3 levels, n-gram chains below (the defaults with AVX-512)
    "tokenswift-gated": {"tree_budget": 4, "draft_depth": 3, "min_draft_score": 0.25},
    "tokenswift-gated8": {"tree_budget": 8, "draft_depth": 3, "min_draft_score": 0.25},
    # 4 nodes, every draft of every level verified (the CPU defaults before the gate)
    "tokenswift-ungated": {"tree_budget": 4, "draft_depth": 256, "min_draft_score": 0.0},
    # gated larger trees with the heads' drafts at every level
    "tokenswift-tree3": {"tree_budget": 3, "draft_depth": 3},
    "tokenswift-tree4": {"tree_budget": 4, "draft_depth": 4},
    "tokenswift-tree16": {"tree_budget": 16, "draft_depth": 16, "min_draft_score": 0.0},  # the CUDA defaults
    "tokenswift-separate-tree16": {"draft_mode": "separate", "tree_budget": 16, "draft_depth": 16,
                                   "min_draft_score": 0.0},
}
METHODS = ("hf", "hf-lookup", "llama.cpp", "ar", "tokenswift", *VARIANTS)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=str(ASSETS / "bench_prompts.jsonl"), help="JSONL with a 'prompt' field")
    p.add_argument("--n-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--lengths", default="1024,4096,8000", help="generated lengths to report, comma-separated")
    p.add_argument("--methods", default="hf,hf-lookup,ar,tokenswift,tokenswift-separate")
    p.add_argument("--sampling", default="studio", choices=["greedy", "studio", "paper"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--plot", default=None, help="write a Plotly chart (HTML) of speedup vs length")
    p.add_argument("--markdown", default=None, metavar="JSON",
                   help="print a saved run (a --json file) as the README shows it, and exit")
    p.add_argument("--hf-max-length", type=int, default=None,
                   help="stop the transformers baselines here (on a CPU, hf-lookup takes over 30 min for 8000 tokens); "
                        "longer lengths report only our methods")


@dataclass
class Run:
    method: str
    prompt: int
    repeat: int
    token_ids: list[int]
    prefill_s: float
    times: list[float]  # decode seconds elapsed when output token i appeared
    steps: int = 0
    accepted: int = 0
    from_ngram: int = 0
    step_tokens: list[int] = field(default_factory=list)  # tokens per step, cumulative boundaries for checkpoints
    step_ngram: list[int] = field(default_factory=list)  # accepted drafts per step that came from the n-gram table
    peak_rss_mb: float = 0.0
    forwards: list[float] = field(default_factory=list)  # of times[i], the seconds spent in the model's forwards
    reads: list[int] = field(default_factory=list)  # by times[i], the bytes the steps had to read (roofline.py)
    read_rate: float | None = None  # this CPU's read rate (bytes/s) sampled right after the run

    def time_at(self, n: int) -> float:
        return self.times[min(n, len(self.times)) - 1]

    def overhead_at(self, n: int) -> float | None:
        """The share of the decode time up to token n spent outside the model's forwards: drafting, the tree, the
        draws, bookkeeping."""
        if not self.forwards:
            return None
        i = min(n, len(self.times)) - 1
        return 1 - self.forwards[i] / self.times[i] if self.times[i] > 0 else None

    def bandwidth_at(self, n: int) -> float | None:
        """Bytes per second the steps up to token n read at least (gpt-fast's "bandwidth achieved")."""
        if not self.reads:
            return None
        i = min(n, len(self.times)) - 1
        return self.reads[i] / self.times[i] if self.times[i] > 0 else None

    def steps_at(self, n: int) -> tuple[int, int, int]:
        """(steps, accepted drafts, n-gram drafts) up to the step that produced token n."""
        if not self.step_tokens:
            return 0, 0, 0
        total, s = 0, 0
        for s, k in enumerate(self.step_tokens, start=1):
            total += k
            if total >= n:
                break
        # every step emits its accepted drafts plus the model's own next token
        return s, total - s, sum(self.step_ngram[:s])


class RssSampler:
    """Peak resident memory of this process while a run is going (psutil, sampled every 50 ms)."""

    def __enter__(self) -> "RssSampler":
        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def method_engine(engine: Engine, method: str) -> Engine:
    """The engine a method runs on: a variant shares the model, heads and compiled graphs and changes one thing."""
    if method not in VARIANTS:
        return engine
    engine = copy.copy(engine)
    engine.notices = []
    changes = VARIANTS[method]
    if changes is None:
        engine.heads = None
    else:
        engine.options = replace(engine.options, **changes)
    return engine


def run_config(method: str, length: int, sampling: Any) -> GenerationConfig:
    """The generation config every run of ours gets: `length` tokens exactly (end-of-sequence suppressed)."""
    return GenerationConfig(max_new_tokens=length, method="ar" if method == "ar" else "tokenswift",
                            sampling=sampling, ignore_eos=True)


def run_ours(engine: Engine, method: str, prompt_ids: list[int], length: int, sampling: Any) -> Run:
    engine = method_engine(engine, method)
    config = run_config(method, length, sampling)
    times: list[float] = []
    step_tokens: list[int] = []
    step_ngram: list[int] = []
    forwards: list[float] = []
    with RssSampler() as rss:
        gen = engine.generate(prompt_ids, config)
        elapsed = forward = 0.0
        for step in gen:
            elapsed += step.seconds
            forward += step.forward_s
            times.extend([elapsed] * len(step.token_ids))
            forwards.extend([forward] * len(step.token_ids))
            step_tokens.append(len(step.token_ids))
            step_ngram.append(step.from_ngram)
    r = gen.result
    assert r is not None
    reads: list[int] = []  # by each token, the bytes its run's steps had read
    total = 0
    for step, read in zip(r.steps, step_reads(engine.model, len(prompt_ids), r.steps)):
        total += read
        reads.extend([total] * len(step.token_ids))
    # after the run and outside its memory sampling: the buffer is freed before the next run
    rate = read_rate_now() if engine.device.type == "cpu" else None
    return Run(method, 0, 0, r.token_ids, r.prefill_s, times, len(r.steps), sum(s.accepted for s in r.steps),
               sum(s.from_ngram for s in r.steps), step_tokens, step_ngram, rss.peak / 2**20, forwards, reads, rate)


def llama_cpp_peer(engine: Engine, methods: list[str]) -> tuple[Path, Path] | None:
    """(llama.cpp's program, the model's GGUF file) when the peer is asked for and can run; else None, said why."""
    if "llama.cpp" not in methods:
        return None
    binary = llama_cpp_binary()
    folder, _ = resolve(engine.loaded.name)
    gguf = gguf_source(folder)
    if binary is None or gguf is None:
        why = f"llama.cpp is not built: {BUILD_HINT}" if binary is None else "the model is not a GGUF file"
        print(f"note: skipping llama.cpp ({why})", file=sys.stderr)
        return None
    return binary, gguf


def run_peer(binary: Path, gguf: Path, prompt: str, lengths: list[int], sampling: Any) -> Run:
    """llama.cpp to each length (one completion each: it reports only a whole run's speed); the run's clock is
    interpolated between the lengths, so time_at(L) is L over its speed to L."""
    at: dict[int, float] = {}
    prefill = 0.0
    for L in lengths:
        tok_s, prefill, n = run_llama_cpp(binary, gguf, prompt, L, sampling, torch.get_num_threads())
        at[L] = n / tok_s
    times, last_n, last_t = [], 0, 0.0
    for L in sorted(at):
        times += [last_t + (at[L] - last_t) * (i - last_n) / (L - last_n) for i in range(last_n + 1, L + 1)]
        last_n, last_t = L, at[L]
    return Run("llama.cpp", 0, 0, [], prefill, times)


def run_hf(hf: Any, method: str, prompt_ids: list[int], length: int, sampling: Any, eos: tuple[int, ...]) -> Run:
    from transformers.generation.streamers import BaseStreamer  # slow to import; only the hf baselines need it

    class Clock(BaseStreamer):
        """Arrival time of every new token (the streamer gets the prompt first, then each sampled token)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.times.extend([time.perf_counter()] * value.numel())

        def end(self) -> None:
            pass

    kwargs: dict[str, Any] = dict(max_new_tokens=length, min_new_tokens=length, suppress_tokens=list(eos),
                                  repetition_penalty=sampling.penalty, pad_token_id=eos[0] if eos else 0)
    if sampling.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                      top_k=sampling.top_k or None, min_p=sampling.min_p or None)
    if method == "hf-lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    clock = Clock()
    torch.manual_seed(sampling.seed)
    ids = torch.tensor([prompt_ids], device=hf.device)
    with RssSampler() as rss, torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock, **kwargs)
    new = out[0, len(prompt_ids):].tolist()
    # the first token comes out of the prefill; decoding is the time after it
    first = clock.times[0]
    times = [t - first for t in clock.times]
    times[0] = times[1] if len(times) > 1 else 0.0
    return Run(method, 0, 0, new, first - t0, times, peak_rss_mb=rss.peak / 2**20)


def explain_runs(engine: Engine, runs: list[Run], prompt_ids: list[list[int]], length: int,
                 sampling: Any) -> dict[tuple[str, int, int], Divergence]:
    """For each TokenSwift run whose ids differ from vanilla decoding's on the same prompt and repeat, vanilla
    decoding's draw where they first differ (core/generation/divergence.py), keyed by (method, prompt, repeat). One
    prefill each, after the timed runs; a failure is said and leaves that run without one."""
    ar = {(r.prompt, r.repeat): r for r in runs if r.method == "ar"}
    out: dict[tuple[str, int, int], Divergence] = {}
    for r in runs:
        base = ar.get((r.prompt, r.repeat))
        if not r.method.startswith("tokenswift") or base is None or first_divergence(base.token_ids, r.token_ids) is None:
            continue
        try:
            found = explain_divergence(engine, prompt_ids[r.prompt], run_config("ar", length, sampling),
                                       base.token_ids, r.token_ids)
        except Exception as e:  # noqa: BLE001  (out of memory, a failed prefill: the figures are worth more)
            print(f"note: {r.method}, prompt {r.prompt}: the draw where it differs could not be recomputed ({e})",
                  file=sys.stderr)
            continue
        if found is not None:
            out[(r.method, r.prompt, r.repeat)] = found
    return out


def distinct(tokens: list[int]) -> list[float]:
    return [round(distinct_n(tokens, n), 4) for n in (1, 2, 3, 4)]


def summarize(runs: list[Run], methods: list[str], lengths: list[int],
              divergences: dict[tuple[str, int, int], Divergence] | None = None) -> list[dict[str, Any]]:
    """One row of figures per (length, method). A TokenSwift row says whether its ids equal vanilla decoding's up to
    the length (`ids_equal_ar`), where they first differ per prompt (`first_divergence`) and, from `divergences`
    (explain_runs), vanilla decoding's draw there: its top-2 gap and the rest (`divergences`)."""
    divergences = divergences or {}
    rows = []
    by = {(r.method, r.prompt, r.repeat): r for r in runs}
    pairs = sorted({(r.prompt, r.repeat) for r in runs})
    for L in lengths:
        reached = {key: r for key, r in by.items() if len(r.times) >= L}  # runs that got this far
        for m in methods:
            mine = [reached[(m, p, k)] for p, k in pairs if (m, p, k) in reached]
            if not mine:
                continue
            tps = [L / r.time_at(L) for r in mine]

            def ratio(base: str) -> float | None:
                vals = [(L / reached[(m, p, k)].time_at(L)) / (L / reached[(base, p, k)].time_at(L))
                        for p, k in pairs if (m, p, k) in reached and (base, p, k) in reached]
                return round(statistics.median(vals), 3) if vals else None

            row: dict[str, Any] = {
                "method": m, "length": L, "runs": len(mine),
                "prefill_s": round(statistics.median(r.prefill_s for r in mine), 3),
                "decode_tok_s": round(statistics.median(tps), 2),
                "speedup_vs_ar": ratio("ar"), "speedup_vs_hf": ratio("hf"),
                "peak_rss_mb": round(max(r.peak_rss_mb for r in mine), 1),
                "overhead": (round(statistics.median(o), 3)
                             if (o := [r.overhead_at(L) for r in mine if r.overhead_at(L) is not None]) else None),
                "bandwidth_gb_s": (float(f"{statistics.median(b) / 1e9:.3g}")
                                   if (b := [r.bandwidth_at(L) for r in mine if r.bandwidth_at(L) is not None])
                                   else None),
                "read_gb_s": (float(f"{statistics.median(g) / 1e9:.3g}")
                              if (g := [r.read_rate for r in mine if r.read_rate is not None]) else None),
                # each run against the rate sampled right after it: this machine's rate drifts
                "bandwidth_share": (round(statistics.median(f), 3) if (f := [
                    r.bandwidth_at(L) / r.read_rate for r in mine
                    if r.bandwidth_at(L) is not None and r.read_rate]) else None),
                "distinct_1_4": ([round(statistics.mean(d), 4) for d in zip(*(distinct(r.token_ids[:L]) for r in mine))]
                                 if all(r.token_ids for r in mine) else None),  # llama.cpp's ids are not read
            }
            if m.startswith("tokenswift"):
                st = [r.steps_at(L) for r in mine]
                steps = sum(s for s, _, _ in st)
                acc = sum(a for _, a, _ in st)
                row.update(tokens_per_step=round(L * len(mine) / steps, 3) if steps else None,
                           alpha=round(acc / (GAMMA * steps), 3) if steps else None,
                           ngram_share=round(sum(g for _, _, g in st) / acc, 3) if acc else 0.0)
                diffs = []
                apart = []  # per diverging prompt: where, and vanilla decoding's draw there when recomputed
                for p, k in pairs:
                    if (m, p, k) in by and ("ar", p, k) in by:
                        a, b = by[("ar", p, k)].token_ids[:L], by[(m, p, k)].token_ids[:L]
                        diffs.append(first_divergence(a, b))
                        if diffs[-1] is not None:
                            found = divergences.get((m, p, k))
                            explained = found.to_dict() if found is not None and found.position == diffs[-1] else {}
                            apart.append({"prompt": p, "repeat": k, "position": diffs[-1], **explained})
                row["ids_equal_ar"] = all(d is None for d in diffs) if diffs else None
                row["first_divergence"] = [d for d in diffs if d is not None]
                if apart:
                    row["divergences"] = apart
            rows.append(row)
    return rows


def pct(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.0f}%"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The figures that compare methods, one row per (length, method); a column no row has a value for is left out
    (the JSON keeps every figure: α, prefill, distinct-n, peak RSS, ...)."""
    def ids(r: dict[str, Any]) -> str | None:
        eq = r.get("ids_equal_ar")
        if eq is None or eq:
            return None if eq is None else "yes"
        if "divergences" not in r:  # a run saved before the gap was recorded
            return f"NO, from {r['first_divergence']}"
        return "NO, from " + ", ".join(str(d["position"]) + (f" (gap {format_gap(d['gap'])})" if "gap" in d else "")
                                       for d in r["divergences"])

    def bandwidth(r: dict[str, Any]) -> str | None:
        bw, share = r.get("bandwidth_gb_s"), r.get("bandwidth_share")
        return None if bw is None else f"{bw}" + (f" ({pct(share)})" if share is not None else "")

    columns = [("length", lambda r: r["length"]), ("method", lambda r: r["method"]),
               ("decode tok/s", lambda r: r["decode_tok_s"]), ("vs ar", lambda r: r["speedup_vs_ar"]),
               ("vs hf", lambda r: r["speedup_vs_hf"]), ("tokens/step", lambda r: r.get("tokens_per_step")),
               ("n-gram share", lambda r: r.get("ngram_share")),
               ("step overhead", lambda r: pct(r["overhead"]) if r.get("overhead") is not None else None),
               ("GB/s (of rate)", bandwidth), ("ids = ar", ids)]
    columns = [(name, get) for name, get in columns if any(get(r) is not None for r in rows)]
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join("–" if (v := get(r)) is None else str(v) for _, get in columns) + " |")
    return "\n".join(lines)


def write_plot(runs: list[Run], path: Path, title: str) -> None:
    import plotly.graph_objects as go  # slow to import; only --plot needs it
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("speedup over ar vs generated length",
                                                        "decode tokens/s over the run"))
    ar = {(r.prompt, r.repeat): r for r in runs if r.method == "ar"}
    for m in sorted({r.method for r in runs}):
        mine = [r for r in runs if r.method == m]
        L = min(len(r.times) for r in mine)
        xs = list(range(128, L + 1, 128))
        if m != "ar" and ar:
            ys = [statistics.median(ar[(r.prompt, r.repeat)].time_at(x) / r.time_at(x) for r in mine
                                    if (r.prompt, r.repeat) in ar) for x in xs]
            fig.add_trace(go.Scatter(x=xs, y=ys, name=f"{m} / ar", mode="lines"), row=1, col=1)
        tps = [statistics.median(x / r.time_at(x) for r in mine) for x in xs]
        fig.add_trace(go.Scatter(x=xs, y=tps, name=f"{m} tok/s", mode="lines"), row=1, col=2)
    fig.update_xaxes(title_text="generated tokens")
    fig.update_layout(title=title, template="plotly_white")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(path), include_plotlyjs=True)


def report_markdown(report: dict[str, Any]) -> str:
    """A saved run (the --json file) as the README shows it: command, machine, table."""
    return run_report(report["settings"]["command"], report["hardware"], markdown(report["rows"]))


def run_bench(args: argparse.Namespace) -> int:
    if args.markdown:
        print(report_markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    lengths = sorted(int(x) for x in args.lengths.split(","))
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = prompts[: args.n_prompts] if args.n_prompts else prompts
    if not prompts:
        raise ValueError(f"no prompts in {args.prompts}")
    engine = load_engine(args)
    ours = [method_engine(engine, m) for m in methods if not m.startswith("hf")] or [engine]
    if args.compile:  # every method's graphs (a variant's larger tree needs a larger one), before any timing
        seconds = sum(e.warm_up() for e in ours)
        print(f"compiling graphs ({seconds:.0f} s)", file=sys.stderr)
    sampling = PRESETS[args.sampling].with_(seed=args.seed)
    prompt_ids = [encode_prompt(engine.tokenizer, p) for p in prompts]
    longest = max(lengths)
    limit = engine.max_context - max(e.max_block for e in ours)
    too_long = [i for i, ids in enumerate(prompt_ids) if len(ids) + longest > limit]
    if too_long:
        raise ValueError(f"--lengths up to {longest} do not fit the model's context of {engine.max_context} tokens "
                         f"with prompt(s) {too_long} (longest prompt {max(map(len, prompt_ids))} tokens); "
                         f"the longest length that fits is {limit - max(map(len, prompt_ids))}")
    peer = llama_cpp_peer(engine, methods)
    if "llama.cpp" in methods and peer is None:
        methods = [m for m in methods if m != "llama.cpp"]
    hf = None
    if any(m.startswith("hf") for m in methods):
        from transformers import AutoModelForCausalLM  # slow to import; only the hf baselines need it

        folder, _ = resolve(engine.loaded.name)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=engine.model.dtype).to(engine.device).eval()
    eos = engine.model.cfg.eos_token_ids
    runs: list[Run] = []
    jobs = [(p, k) for k in range(args.repeats) for p in range(len(prompts))]
    total = len(jobs) * len(methods)
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
    for j, (p, k) in enumerate(jobs):
        order = methods[j % len(methods):] + methods[: j % len(methods)]  # rotate: drift hits every method
        for m in order:
            bar.set_postfix_str(f"{m} prompt {p} repeat {k}")
            if m.startswith("hf"):
                r = run_hf(hf, m, prompt_ids[p], min(longest, args.hf_max_length or longest), sampling, eos)
            elif m == "llama.cpp":
                assert peer is not None
                text = engine.tokenizer.decode(prompt_ids[p], skip_special_tokens=False)
                r = run_peer(*peer, text, lengths, sampling)
            else:
                r = run_ours(engine, m, prompt_ids[p], longest, sampling)
            r.prompt, r.repeat = p, k
            runs.append(r)
            bar.update(1)
    bar.close()
    rows = summarize(runs, methods, lengths, explain_runs(engine, runs, prompt_ids, longest, sampling))
    print(markdown(rows))
    report = {"settings": {"sampling": args.sampling, **sampling.to_dict(), "lengths": lengths, "methods": methods,
                           "prompts": len(prompts), "repeats": args.repeats, "model": engine.loaded.name,
                           "heads": getattr(engine.heads, "meta", {}).get("base_model") if engine.heads else None,
                           "options": asdict(engine.options), "compile": args.compile,
                           "command": args.command_line},
              "hardware": hardware(), "rows": rows}
    if args.json:  # a missing folder must not cost the run's figures
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        write_plot(runs, Path(args.plot), f"{engine.loaded.name}, {args.sampling} sampling")
    return 0
