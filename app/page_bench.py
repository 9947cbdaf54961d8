"""How fast the studio writes while a browser page watches the run: the worker's torch thread count against a live
page drawn on the same machine.

    python -m app.page_bench [--threads 1,all] [--pages on,off] [--max-new-tokens 300] [--repeats 3]
                             [--compile] [--model SPEC] [--json OUT]

Each thread setting gets its own `app.py` (threads are fixed when the worker starts: compiled kernels bake the count
in), started in turn and in a rotated order each repeat. On each server the same run (one chapter regenerated from the
same premise and seed: the same tokens every time) is decoded with a headless Chromium page open on that chapter
(`on`: the Write tab's text and counts update every second, its charts every few, as a writer sees them) and with
no page (`off`), in a rotated order. Reported: the run's decode tokens/s (the worker's own figure), median over
repeats, and each setting's ratio to `all` threads with the same page mode. Prints a markdown table; `--json` writes
every run.

`auto` is the app's default (torch's choice); `all` passes every CPU; a number passes that count.
Needs Debian's chromium at /usr/bin/chromium (`make browser`) for `--pages on`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import storage
from app import jobs
from app.studio_process import studio_server
from app.views import ACTIVE
from app.worker import parse_threads, usable_cpus

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
RUN_TIMEOUT_S = 1800
PREMISE = "A harbour master in a northern port keeps a diary through the longest winter anyone remembers."
INSTRUCTIONS = "The ice closes the harbour; the town waits for a ship that is late."


@dataclass
class PageRun:
    threads: str
    page: str
    repeat: int
    n_tokens: int
    decode_s: float
    tokens_per_s: float
    text_sha1: str


def thread_flag(setting: str) -> str:
    """app.py's --threads value for a setting: auto, all (every CPU) or a number."""
    return str(usable_cpus()) if setting == "all" else setting


def wait_done(db: storage.Database, run_id: int, timeout_s: float = RUN_TIMEOUT_S) -> storage.Run:
    deadline = time.monotonic() + timeout_s
    while True:
        run = storage.get_run(db, run_id)
        if run.status not in ACTIVE:
            if run.status != "done":
                raise RuntimeError(f"run {run_id} ended {run.status}: {run.error}")
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} did not finish in {timeout_s:g} s")
        time.sleep(0.5)


def open_page(browser: Any, url: str, project_title: str) -> Any:
    """A page on the project's first chapter, as a writer would open it (the Write tab, charts beside the text)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector("#chapter-list")
    page.locator("#project-picker input").click()
    page.get_by_role("option", name=project_title).first.click()
    page.locator("#chapter-list").get_by_text("1.", exact=False).first.wait_for()
    return context


def measure(args: argparse.Namespace, folder: Path, browser: Any) -> list[PageRun]:
    db_path = folder / "page-bench.db"
    title = "Page bench"
    with storage.open_database(db_path) as db:
        project = storage.create_project(db, title, premise=PREMISE)
        chapter = storage.add_chapter(db, project.id, instructions=INSTRUCTIONS)
    settings = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "seed": args.seed}
    server_args = ("--model", args.model, "--compile" if args.compile else "--no-compile")
    runs: list[PageRun] = []
    total = args.repeats * len(args.threads) * len(args.pages)
    for repeat in range(args.repeats):
        shift = repeat % len(args.threads)
        for threads in args.threads[shift:] + args.threads[:shift]:
            log_path = folder / f"server-{repeat}-{threads}.log"
            with studio_server(db_path, log_path, args=(*server_args, "--threads", thread_flag(threads)),
                               start_timeout_s=1200 if args.compile else 300) as server, \
                    storage.open_database(db_path) as db:
                # A short run first: a fresh server's first run pays one-time costs (allocations, lazy set-up).
                wait_done(db, jobs.queue_chapter_run(db, chapter.id, "regenerate", {**settings, "max_new_tokens": 16},
                                                     model=args.model).id)
                pages = args.pages if repeat % 2 == 0 else args.pages[::-1]
                for page in pages:
                    context = open_page(browser, server.url, title) if page == "on" else None
                    try:
                        queued = jobs.queue_chapter_run(db, chapter.id, "regenerate", settings, model=args.model)
                        run = wait_done(db, queued.id)
                    finally:
                        if context is not None:
                            context.close()
                    runs.append(PageRun(threads, page, repeat, run.n_tokens, run.decode_s or 0.0,
                                        run.tokens_per_s or 0.0, hashlib.sha1(run.text.encode()).hexdigest()[:12]))
                    print(f"[{len(runs)}/{total}] threads {threads}, page {page}: {run.tokens_per_s:.2f} tokens/s",
                          file=sys.stderr, flush=True)
    return runs


def summarize(runs: list[PageRun], threads: list[str], pages: list[str]) -> list[dict[str, Any]]:
    """One row per (threads, page): median decode tokens/s over repeats and the ratio to `all` threads with the same
    page mode (median of the per-repeat ratios, as both ran on the same repeat)."""
    rows = []
    for page in pages:
        base = {r.repeat: r.tokens_per_s for r in runs if r.page == page and r.threads == "all"}
        for t in threads:
            mine = [r for r in runs if r.page == page and r.threads == t]
            ratios = [r.tokens_per_s / base[r.repeat] for r in mine if base.get(r.repeat)]
            rows.append({"threads": t, "page": page, "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
                         "vs_all": statistics.median(ratios) if ratios else None, "runs": len(mine)})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| threads | page open | decode tok/s (median) | vs all threads | runs |", "|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['vs_all']:.2f}" if r["vs_all"] is not None else ""
        lines.append(f"| {r['threads']} | {r['page']} | {r['tokens_per_s']:.1f} | {vs} | {r['runs']} |")
    return "\n".join(lines)


def _list(value: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    for v in items:
        if allowed is not None and v not in allowed:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {v!r}")
        if allowed is None and v != "all":
            try:
                parse_threads(v)
            except ValueError as e:
                raise argparse.ArgumentTypeError(f"{e} (or all)") from None
    if not items:
        raise argparse.ArgumentTypeError("the list is empty")
    return items


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.page_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=_list, default=["1", "all"],
                   help="thread settings to compare: auto, all, or a number (default: 1,all)")
    p.add_argument("--pages", type=lambda v: _list(v, ("on", "off")), default=["on", "off"],
                   help="with a browser page open on the run (on) and without (off); default: on,off")
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--compile", action="store_true",
                   help="compiled graphs (each server compiles them first: 3-4 minutes a start on 2 cores)")
    p.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.max_new_tokens <= jobs.DEFAULT_CONTEXT - jobs.PROMPT_RESERVE or args.repeats < 1:
        print("error: --max-new-tokens must be 1..7680 and --repeats at least 1", file=sys.stderr)
        return 2
    if "all" not in args.threads:
        args.threads.append("all")  # the reference every ratio is taken against
    if "on" in args.pages and not os.path.exists(CHROMIUM):
        print(f"error: {CHROMIUM} is missing (`make browser`); or run with --pages off", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    from core.tools.hardware import hardware

    with tempfile.TemporaryDirectory(prefix="page-bench-") as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS) if "on" in args.pages else None
        try:
            runs = measure(args, Path(tmp), browser)
        finally:
            if browser is not None:
                browser.close()
    rows = summarize(runs, args.threads, args.pages)
    same = len({r.text_sha1 for r in runs}) == 1
    info = {**hardware(), "cpus": usable_cpus()}
    info.pop("threads", None)  # this process's, not the servers'
    print(markdown(rows))
    print(f"\n{info.get('cpu', '')}, {info['cpus']} CPUs; {args.max_new_tokens} tokens a run, "
          f"{'compiled' if args.compile else 'eager'}; every run wrote the same text: {'yes' if same else 'NO'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"hardware": info, "settings": {k: str(v) if isinstance(v, Path) else v
                                                                         for k, v in vars(args).items()},
                                         "summary": rows, "same_text": same, "runs": [asdict(r) for r in runs]},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
