"""Small pure formatters from storage rows to what the page shows: badges, status lines, labels, tables.

Everything user- or model-written that ends up in HTML passes through ``esc`` here, so the UI module never builds
markup from raw text. No Gradio, no database access: easy to unit-test.
"""
from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from core.generation.agreement import format_gap

METHOD_LABELS = {"tokenswift": "TokenSwift", "ar": "Vanilla"}
MODE_LABELS = {"generate": "Generate", "continue": "Continue", "regenerate": "Regenerate", "resume": "Resume",
               "compare": "Compare", "summary": "Summary", "outline": "Outline"}
STATUS_LABELS = {"queued": "queued", "running": "running", "done": "done", "failed": "failed",
                 "cancelled": "stopped", "interrupted": "interrupted"}
ACTIVE = ("queued", "running")
# Worker states in order of preference when several workers report (one ready worker is enough).
WORKER_STATES = {"ready": ("done", "Worker ready"), "compiling": ("running", "Compiling…"),
                 "loading model": ("running", "Loading model…"), "failed": ("failed", "Worker failed"),
                 "stopped": ("queued", "Worker stopped")}
# A worker rewrites its state row at least every ~10 s while it lives (idle, loading or generating: app/worker.py).
# A row older than this belongs to a worker that died without saying so (SIGKILL, out of memory, a lost machine).
# "stopped" and "failed" are last words, not heartbeats: they never go stale.
WORKER_STALE_S = 60.0
FINAL_WORKER_STATES = ("stopped", "failed")


def esc(text: Any) -> str:
    """HTML-escape anything (None becomes empty)."""
    return html.escape("" if text is None else str(text), quote=True)


def badge(kind: str, label: str | None = None) -> str:
    """A status pill (styles in assets/studio.css: badge-queued, badge-running, ...)."""
    kind = kind if kind in ("queued", "running", "done", "failed", "interrupted", "cancelled") else "queued"
    return f'<span class="badge-{kind}">{esc(label if label is not None else STATUS_LABELS.get(kind, kind))}</span>'


def fmt_int(n: int | None) -> str:
    return "–" if n is None else f"{int(n):,}"


def fmt_float(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def short(text: str, limit: int = 80) -> str:
    """One line, at most ``limit`` characters (for labels and tables)."""
    line = " ".join((text or "").split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


# -- worker ----------------------------------------------------------------------------------------------------------

def utcnow() -> datetime:
    """Naive UTC, the convention of the database's timestamps (storage.models.utcnow)."""
    return datetime.now(UTC).replace(tzinfo=None)


def worker_age_s(state: Any, now: datetime | None = None) -> float | None:
    """Seconds since a worker last wrote its state row (None if unknown)."""
    if state.updated_at is None:
        return None
    return ((now or utcnow()) - state.updated_at).total_seconds()


def worker_is_stale(state: Any, now: datetime | None = None, stale_after_s: float = WORKER_STALE_S) -> bool:
    """A live-looking state ("ready", "loading model", ...) that has not been refreshed for ``stale_after_s``."""
    if state.state in FINAL_WORKER_STATES:
        return False
    age = worker_age_s(state, now)
    return age is not None and age > stale_after_s


def ago(seconds: float) -> str:
    """A coarse age ("2 min ago", "3 h ago", "2 days ago"): it changes at most once a minute, so the page's poll
    does not resend the header every second."""
    minutes = max(1, int(seconds // 60))
    if minutes < 60:
        return f"{minutes} min ago"
    hours = minutes // 60
    if hours < 48:
        return f"{hours} h ago"
    return f"{hours // 24} days ago"


def responsive_workers(states: Sequence[Any], now: datetime | None = None, zerogpu: bool = False) -> list[Any]:
    """The rows of workers that are alive or ended cleanly (stale rows of dead workers left out). On ZeroGPU the
    worker only acts inside requests, so its row is not refreshed while idle: nothing is stale there."""
    if zerogpu:
        return list(states)
    now = now or utcnow()
    return [s for s in states if not worker_is_stale(s, now)]


def worker_badge(states: Sequence[Any], zerogpu: bool = False, now: datetime | None = None) -> str:
    """The header's worker line from ``get_worker_states`` rows (``now``: naive UTC, for tests)."""
    note = ' <span class="muted">· ZeroGPU: a GPU is attached for each chunk of generation</span>' if zerogpu else ""
    now = now or utcnow()
    fresh = responsive_workers(states, now, zerogpu)
    live = [s for s in fresh if s.state != "stopped"]
    stale = [] if zerogpu else [s for s in states if worker_is_stale(s, now)]
    if not live and stale:
        # Only dead workers claim to be busy: say so, instead of their last (stale) word.
        last = max(stale, key=lambda s: s.updated_at)
        detail = f"last seen {ago(worker_age_s(last, now) or 0)}"
        if last.model:
            detail = f"{model_name(last.model)} · {detail}"
        return (f'<div class="worker-line">{badge("failed", "Worker not responding")} '
                f'<span class="muted">{esc(detail)}; queued runs wait until it is restarted</span></div>')
    live = live or fresh
    if not live and zerogpu:
        return f'<div class="worker-line">{badge("queued", "ZeroGPU")}{note}</div>'
    if not live:
        return (f'<div class="worker-line">{badge("queued", "No worker")} <span class="muted">start one with '
                "<code>python -m app.worker</code>; queued runs wait for it</span></div>")
    order = list(WORKER_STATES)
    best = min(live, key=lambda s: (order.index(s.state) if s.state in order else len(order),
                                    -(s.updated_at.timestamp() if s.updated_at else 0)))
    kind, label = WORKER_STATES.get(best.state, ("queued", best.state))
    detail = best.message or ""
    if best.model and best.state in ("ready", "loading model", "compiling"):
        detail = model_name(best.model) + (f" · {detail}" if detail else "")
    extra = f' <span class="muted">{esc(short(detail, 120))}</span>' if detail else ""
    more = len([s for s in live if s.state == "ready"])
    if more > 1:
        extra += f' <span class="muted">({more} workers)</span>'
    return f'<div class="worker-line">{badge(kind, label)}{extra}{note}</div>'


def model_name(spec: str) -> str:
    """A model spec as shown: a path becomes its last part ("/data/models/llama-3b" -> "llama-3b")."""
    spec = spec.rstrip("/\\")
    return spec.replace("\\", "/").rsplit("/", 1)[-1] if ("/" in spec and spec.startswith(("/", ".", "~"))) else spec


# -- runs ------------------------------------------------------------------------------------------------------------

def run_status(run: Any | None, *, position: int | None = None, tokens_per_s: float | None = None,
               tokens_per_step: float | None = None, worker_ready: bool = True) -> str:
    """The status line under the chapter buttons for its latest run (HTML)."""
    if run is None:
        return '<div class="run-status">Not written yet: add a premise, then press <b>Generate</b>.</div>'
    method = METHOD_LABELS.get(run.method, run.method)
    tps = tokens_per_s if tokens_per_s is not None else run.tokens_per_s
    per_step = tokens_per_step if tokens_per_step is not None else run.mean_accepted
    numbers = (f'<span class="num">{fmt_int(run.n_tokens)}</span> tokens · '
               f'<span class="num">{fmt_float(tps)}</span> tok/s · '
               f'<span class="num">{fmt_float(per_step, 2)}</span> tokens/step')
    what = f"{esc(MODE_LABELS.get(run.mode, run.mode))} · {esc(method)}"
    status = run.status
    if status == "queued":
        where = f"position {position} in the queue" if position else "in the queue"
        wait = "" if worker_ready else " · waiting for the worker"
        body = f"{badge('queued')} {what} · {where}{wait}"
    elif status == "running":
        body = f"{badge('running')} {what} · {numbers}"
    elif status == "done":
        body = f"{badge('done')} {what} · {numbers}"
    elif status == "failed":
        body = f"{badge('failed')} {what} · {esc(run.error or 'The run failed.')}"
    elif status == "cancelled":
        body = (f"{badge('cancelled', 'stopped')} {what} · stopped after {fmt_int(run.n_tokens)} tokens"
                + ("; <b>Resume</b> carries on exactly, <b>Continue</b> starts a fresh run after the text"
                   if run.n_tokens else ""))
    elif status == "interrupted":
        body = (f"{badge('interrupted')} {what} · interrupted after {fmt_int(run.n_tokens)} tokens; "
                "press <b>Resume</b> to carry on exactly where it stopped")
    else:
        body = f"{badge('queued', status)} {what}"
    return f'<div class="run-status">{body}</div>'


def counts_line(words: int, chars: int | None, run_tokens: int | None, tail_chars: int | None = None) -> str:
    """Words / characters of the chapter and tokens of its latest run (Markdown-free HTML)."""
    parts = [f'<span class="num">{fmt_int(words)}</span> words']
    if chars is not None:
        parts.append(f'<span class="num">{fmt_int(chars)}</span> characters')
    if run_tokens is not None:
        parts.append(f'<span class="num">{fmt_int(run_tokens)}</span> tokens in the latest run')
    if tail_chars:
        parts.append(f"showing the last {fmt_int(tail_chars)} characters while it is written")
    return f'<div class="run-status counts">{" · ".join(parts)}</div>'


def chapter_label(position: int, chapter: Any) -> str:
    """A chapter-list entry: "3. Title ✓" (✓ done, ● being written)."""
    mark = {"done": " ✓", "generating": " ●"}.get(chapter.status, "")
    return f"{position + 1}. {short(chapter.title, 60)}{mark}"


def project_label(project: Any) -> str:
    return f"{short(project.title, 60)} ({project.kind})"


def run_label(run: Any) -> str:
    """A run-picker entry: "#12 · TokenSwift · generate · done · 512 tokens"."""
    return (f"#{run.id} · {METHOD_LABELS.get(run.method, run.method)} · {run.mode} · "
            f"{STATUS_LABELS.get(run.status, run.status)} · {fmt_int(run.n_tokens)} tokens")


def when(ts: datetime | None) -> str:
    return ts.strftime("%Y-%m-%d %H:%M") if ts else ""


RUN_COLUMNS = ["Run", "Queued (UTC)", "Chapter", "Mode", "Method", "Tokens", "tok/s", "tok/step", "Speedup",
               "Status"]


def runs_table(runs: Iterable[Any], chapter_titles: Mapping[int, str], speedups: Mapping[int, float]) -> list[list]:
    """Rows for the History table (plain values; the Dataframe renders them as text)."""
    rows = []
    for r in runs:
        rows.append([
            r.id, when(r.queued_at),
            short(chapter_titles.get(r.chapter_id, "") if r.chapter_id else
                  chapter_titles.get(r.summary_of, "") if r.summary_of else
                  ("(compare)" if r.comparison_id else "(outline)" if r.mode == "outline" else ""), 40),
            r.mode, METHOD_LABELS.get(r.method, r.method), r.n_tokens,
            round(r.tokens_per_s, 1) if r.tokens_per_s else None,
            round(r.mean_accepted, 2) if r.mean_accepted else None,
            f"{speedups[r.id]:.2f}×" if r.id in speedups else "",
            STATUS_LABELS.get(r.status, r.status),
        ])
    return rows


def speedup(ar: Any | None, ts: Any | None) -> float | None:
    """TokenSwift decode tokens/s over vanilla's, when both are known."""
    if ar is None or ts is None or not ar.tokens_per_s or not ts.tokens_per_s:
        return None
    return ts.tokens_per_s / ar.tokens_per_s


def run_summary(run: Any, *, chapter_title: str | None = None, tokens_per_step: float | None = None,
                speedup_x: float | None = None) -> str:
    """The History tab's card for one run (HTML)."""
    rows = [
        ("Run", f"#{run.id} · {esc(MODE_LABELS.get(run.mode, run.mode))}"),
        ("Method", esc(METHOD_LABELS.get(run.method, run.method))),
        ("Status", badge(run.status if run.status in STATUS_LABELS else "queued", STATUS_LABELS.get(run.status))),
        ("Chapter", esc(chapter_title) if chapter_title else "–"),
        ("Model", esc(run.model) + (f" · heads {esc(run.heads)}" if run.heads else "")),
        ("Tokens", fmt_int(run.n_tokens)),
        ("Decode", f"{fmt_float(run.tokens_per_s)} tok/s"
                   + (f" in {fmt_float(run.decode_s, 2)} s" if run.decode_s else "")),
        ("Prefill", f"{fmt_float(run.prefill_s, 2)} s"),
        ("Tokens/step", fmt_float(tokens_per_step if tokens_per_step is not None else run.mean_accepted, 2)),
    ]
    if speedup_x is not None:
        rows.append(("Speedup", f"{speedup_x:.2f}× over vanilla"))
    if run.settings:
        rows.append(("Settings", esc(", ".join(f"{k}={v}" for k, v in sorted(run.settings.items())))))
    if run.error:
        rows.append(("Message", esc(run.error)))
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


# -- compare ---------------------------------------------------------------------------------------------------------

def tile(label: str, value: str, note: str = "", kind: str = "") -> str:
    cls = f"tile {kind}".strip()
    note_html = f'<div class="tile-note">{note}</div>' if note else ""
    return (f'<div class="{cls}"><div class="tile-label">{esc(label)}</div>'
            f'<div class="tile-value">{value}</div>{note_html}</div>')


def compare_summary(comparison: Any | None, ar: Any | None, ts: Any | None,
                    ar_steps: float | None = None, ts_steps: float | None = None) -> str:
    """Metric tiles for a comparison: throughput of each, speedup, tokens/step, identical tokens (HTML)."""
    if comparison is None:
        return ('<div class="compare-empty">Run a comparison: the same prompt, seed and settings are decoded with '
                "vanilla decoding, then with TokenSwift, on the same worker.</div>")
    x = speedup(ar, ts)

    def tps(run: Any | None) -> str:
        if run is None:
            return "–"
        if run.tokens_per_s:
            return f"{run.tokens_per_s:,.1f}<small> tok/s</small>"
        return STATUS_LABELS.get(run.status, run.status)

    if comparison.tokens_match is True:
        same = tile("Identical tokens", "✓ yes", "lossless: the same token ids", "good")
    elif comparison.tokens_match is False:
        same = tile("Identical tokens", "✗ no", f"first differ at token {fmt_int(comparison.first_divergence)}"
                    + (f" · top-2 gap {esc(gap)}" if (gap := divergence_gap(comparison)) else ""), "bad")
    else:
        same = tile("Identical tokens", "…", "known when both runs are done")
    ar_per = ar_steps if ar_steps is not None else (ar.mean_accepted if ar else None)
    ts_per = ts_steps if ts_steps is not None else (ts.mean_accepted if ts else None)
    tiles = [
        tile("Vanilla", tps(ar), f"{fmt_int(ar.n_tokens if ar else None)} tokens"),
        tile("TokenSwift", tps(ts), f"{fmt_int(ts.n_tokens if ts else None)} tokens"),
        tile("Speedup", f"{x:.2f}×" if x else "…", "decode tokens/s, TokenSwift over vanilla",
             "accent" if x else ""),
        tile("Tokens per step", f"{fmt_float(ar_per, 2)} → {fmt_float(ts_per, 2)}", "vanilla → TokenSwift"),
        same,
    ]
    return f'<div class="tiles">{"".join(tiles)}</div>'


def divergence_gap(comparison: Any) -> str | None:
    """The top-2 gap of vanilla decoding's draw where a comparison's runs first differ, as written (None until the
    worker has stored it, and for comparisons made before it did)."""
    found = getattr(comparison, "divergence", None) or {}
    return format_gap(found["gap"]) if "gap" in found else None


def compare_run_line(label: str, run: Any | None, position: int | None = None) -> str:
    if run is None:
        return f'<div class="run-status"><b>{esc(label)}</b></div>'
    if run.status == "queued":
        state = badge("queued") + (f" position {position} in the queue" if position else "")
    elif run.status == "failed":
        state = badge("failed") + " " + esc(run.error or "")
    else:
        state = (badge(run.status if run.status in STATUS_LABELS else "queued", STATUS_LABELS.get(run.status))
                 + f' <span class="num">{fmt_int(run.n_tokens)}</span> tokens'
                 + (f' · <span class="num">{fmt_float(run.tokens_per_s)}</span> tok/s' if run.tokens_per_s else ""))
    return f'<div class="run-status"><b>{esc(label)}</b> {state}</div>'


COMPARE_COLUMNS = ["#", "Created (UTC)", "Prompt", "Tokens", "Vanilla tok/s", "TokenSwift tok/s", "Speedup",
                   "Identical"]


def comparison_label(c: Any) -> str:
    return f"#{c.id} · {short(c.prompt, 50)}"


def comparisons_table(comparisons: Iterable[Any], runs: Mapping[int, Any]) -> list[list]:
    rows = []
    for c in comparisons:
        ar, ts = runs.get(c.ar_run_id), runs.get(c.tokenswift_run_id)
        x = speedup(ar, ts)
        gap = divergence_gap(c) if c.tokens_match is False else None
        same = {True: "yes", False: f"no (token {c.first_divergence}" + (f", gap {gap})" if gap else ")"),
                None: "…"}[c.tokens_match]
        rows.append([c.id, when(c.created_at), short(c.prompt, 60), ts.n_tokens if ts else None,
                     round(ar.tokens_per_s, 1) if ar and ar.tokens_per_s else None,
                     round(ts.tokens_per_s, 1) if ts and ts.tokens_per_s else None,
                     f"{x:.2f}×" if x else "", same])
    return rows


# -- revisions -------------------------------------------------------------------------------------------------------

REVISION_CAUSES = {"manual edit": "hand edit", "regenerate": "before regenerate"}
DIFF_CONTEXT = 1  # unchanged paragraphs shown around each change


def revision_label(revision: Any) -> str:
    """'#12 · 2026-12-03 14:03 · hand edit · 1,234 words' for the revision picker."""
    cause = REVISION_CAUSES.get(revision.reason, revision.reason)
    return f"#{revision.id} · {when(revision.created_at)} · {cause} · {fmt_int(len(revision.text.split()))} words"


def revision_diff(old: str, new: str) -> str:
    """HTML of what changed from a revision (``old``) to the current text (``new``), paragraph by paragraph: removed
    paragraphs struck through, added ones underlined, long unchanged stretches folded."""
    import difflib

    if old == new:
        return '<div class="muted">This revision is the same as the current text.</div>'
    a, b = old.split("\n"), new.split("\n")
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    changes = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    removed = sum(len(" ".join(a[i1:i2]).split()) for _, i1, i2, _, _ in changes)
    added = sum(len(" ".join(b[j1:j2]).split()) for _, _, _, j1, j2 in changes)
    parts = [(f'<div class="diff-summary">Since this revision: <ins>+{fmt_int(added)} words</ins> · '
              f'<del>−{fmt_int(removed)} words</del></div>')]
    for group in matcher.get_grouped_opcodes(DIFF_CONTEXT):
        parts.append('<div class="diff-hunk">')
        for op, i1, i2, j1, j2 in group:
            if op == "equal":
                parts += [f"<p>{esc(line)}</p>" for line in a[i1:i2] if line.strip()]
                continue
            parts += [f"<p><del>{esc(line)}</del></p>" for line in a[i1:i2] if line.strip()]
            parts += [f"<p><ins>{esc(line)}</ins></p>" for line in b[j1:j2] if line.strip()]
        parts.append("</div>")
    return '<div class="revision-diff">' + "".join(parts) + "</div>"


def goal_line(words: int, goal: int | None) -> str:
    """The sidebar's progress towards a project's word goal (empty without a goal)."""
    if not goal:
        return ""
    share = min(words / goal, 1.0)
    done = " · reached ✓" if words >= goal else ""
    bar = f'<div class="goal-bar"><span style="width:{share * 100:.1f}%"></span></div>'
    return (f'<div class="goal"><div class="goal-text">{fmt_int(words)} / {fmt_int(goal)} words '
            f"({share:.0%}){done}</div>{bar}</div>")


# -- the story's memory ---------------------------------------------------------------------------------------------

def _numbers(numbers: Sequence[int], noun: str = "chapter") -> str:
    """ "chapter 3", "chapters 1–4", "chapters 1, 3 and 6"."""
    numbers = sorted(numbers)
    if len(numbers) == 1:
        return f"{noun} {numbers[0]}"
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{noun}s {numbers[0]}–{numbers[-1]}"
    return f"{noun}s {', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"


def prompt_line(info: Mapping[str, Any] | None) -> str:
    """What went into a chapter run's prompt (app.prompting.PromptReport as a dict), as one line of HTML, e.g.
    "prompt 5,830 of 7,104 tokens: 310 premise/lore, 4 summaries, last 5,200 tokens of chapter 7"."""
    if not info or "total" not in info:
        return ""
    try:
        total, budget = int(info["total"]), int(info["budget"])
        other = total - int(info["summary_tokens"]) - int(info["text_tokens"]) - int(info["own_tokens"])
        parts = [f"{other:,} premise/lore" + (f" ({len(info['lore'])} lore)" if info["lore"] else "")]
        if info["own_tokens"]:
            parts.append(f"{int(info['own_tokens']):,} of this chapter")
        if info["summaries"]:
            n = len(info["summaries"])
            parts.append(f"{n} summar{'y' if n == 1 else 'ies'}")
        if info["whole"]:
            parts.append(_numbers(info["whole"]) + " whole")
        if info["tail_chapter"]:
            parts.append(f"last {int(info['tail_tokens']):,} tokens of chapter {int(info['tail_chapter'])}")
        out = []
        if info["unsummarized"]:
            out.append(f"{_numbers(info['unsummarized'])} (no summary)")
        if info["summaries_left_out"]:
            out.append(f"summaries of {_numbers(info['summaries_left_out'])}")
        if info["lore_left_out"]:
            out.append(f"lore {', '.join(info['lore_left_out'])}")
    except (KeyError, TypeError, ValueError):
        return ""  # an older or damaged record: say nothing rather than something wrong
    left = f" · left out: {'; '.join(out)}" if out else ""
    return (f'<div class="prompt-line" title="What the model saw for this run">prompt {total:,} of {budget:,} '
            f"tokens: {esc(', '.join(parts))}{esc(left)}</div>")


def summary_note(chapter: Any | None, run: Any | None) -> str:
    """Under a chapter's summary: who wrote it, and the summary run's state (HTML)."""
    if chapter is None:
        return ""
    if run is not None and run.status in ACTIVE:
        return f'<div class="muted">{badge(run.status)} the model is writing this summary (run #{run.id})…</div>'
    if run is not None and run.status == "failed" and chapter.summary_source != "writer":
        return f'<div class="muted">{badge("failed")} {esc(run.error or "The summary run failed.")}</div>'
    if chapter.summary_source == "writer":
        return ('<div class="muted">Your own summary: automatic summaries leave it alone; '
                "<b>Summarize again</b> replaces it.</div>")
    if chapter.summary_source == "model" and chapter.summary.strip():
        return ('<div class="muted">Written by the model after the chapter\'s run; edit it and save to make it '
                "yours.</div>")
    return ('<div class="muted">No summary yet. When this chapter no longer fits whole into a later chapter\'s '
            "prompt, its summary goes there instead.</div>")


OUTLINE_COLUMNS = ["Title", "Instructions"]
LORE_COLUMNS = ["Name", "Keywords", "Text"]


def outline_status(run: Any | None) -> str:
    """The state of the project's latest outline run (HTML)."""
    if run is None:
        return ('<div class="muted">The model proposes chapters from the premise; edit the table, then apply it. '
                "Or type an outline yourself.</div>")
    if run.status in ACTIVE:
        return (f'<div class="muted">{badge(run.status)} proposing an outline (run #{run.id}, '
                f"{fmt_int(run.n_tokens)} tokens)…</div>")
    if run.status == "done":
        return f'<div class="muted">{badge("done")} outline proposed by run #{run.id}: edit it, then apply it.</div>'
    return f'<div class="muted">{badge(run.status)} {esc(run.error or "The outline run did not finish.")}</div>'


def summaries_overview(chapters: Sequence[Any]) -> str:
    """Every chapter's summary at a glance (HTML)."""
    if not chapters:
        return '<div class="muted">No chapters yet.</div>'
    rows = []
    for i, c in enumerate(chapters):
        text = esc(short(c.summary, 300)) if c.summary.strip() else '<span class="muted">no summary</span>'
        rows.append(f"<tr><td>{i + 1}</td><td>{esc(c.title)}</td><td>{fmt_int(c.word_count)}</td><td>{text}</td></tr>")
    return ('<table class="summaries"><thead><tr><th>#</th><th>Chapter</th><th>Words</th><th>Summary</th></tr>'
            f"</thead><tbody>{''.join(rows)}</tbody></table>")
