"""The background generation worker: claims queued runs, generates them, streams text and metrics into storage.

One `Worker` owns one engine (loaded once, lazily, in the worker's own thread) and runs queued runs oldest first.
It is the only writer of generated text. Use it in-process (`Worker(db).start()`, as app.py does), as its own
process (`python -m app.worker --db PATH --model SPEC`; several may share one database, the atomic claim hands each
run to exactly one), or one chunk at a time (`process_one(time_budget_s=...)`, for ZeroGPU, where the GPU exists
only inside a request).

What the UI sees (all through storage):
- worker state: "loading model" → ("compiling", with compile=True) → "ready", or "failed" with the reason;
  "stopped" at the end. With compile=None (auto) and a CPU model on PyTorch's operators (our kernels off or not
  built; a model on our kernels has nothing to compile) the worker is "ready" after loading, runs
  eagerly, and compiles the graphs one at a time while its queue is empty (_compile_step), swapping them in between
  runs. The message says what the worker is doing and ends with the engine's one-time notices ("Note: no trained
  drafting heads for this model: …"), so the header line can show them without a separate channel.
- run progress: text, token ids and step rows appended every FLUSH_S (0.5 s) in one short transaction, plus the
  first step at once; a heartbeat thread keeps the run's heartbeat fresh through long prefills.
- liveness: the worker rewrites its state row at least every STATE_REFRESH_S while it lives (the idle loop, a
  heartbeat thread while loading the model and while a run is generated), so a worker killed without a word
  (SIGKILL, out of memory) is recognisable by its stale timestamp: the UI then says it is not responding.
- run end: done / cancelled / failed with a readable message (the traceback goes to the log) / interrupted.

Chunked runs (`time_budget_s`): when the budget is spent the output so far is flushed and the run stays "running"
(owned by this worker id); the next `process_one` call finds it first and continues it with its own stored token
ids as `resume_ids`. Sampling is position-keyed, so the chunks add up to exactly the uninterrupted output. A resume
run ("resume" mode) works the same way with the token ids of the runs it resumes (app.jobs.resume_chain). A run's
stored text is its ids decoded, less a character its last ids leave unfinished: that character is written by the
run that resumes it.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import storage as st
from app.jobs import queue_summary, resume_chain, user_settings, validate_settings
from app.prompting import build_chapter_prompt, prompt_budget, summary_prompt
from core.generation.metrics import REPETITION_WINDOW, RepetitionTracker
from storage.queries import CHAPTER_MODES

if TYPE_CHECKING:
    import torch

    from core.engine import Engine
    from core.generation.decoding import GenerationConfig

log = logging.getLogger(__name__)

FLUSH_S = 0.5  # the UI polls about this often; each flush rewrites the run row, so never per token
CANCEL_CHECK_S = 0.1  # a GPU step can take a few ms: polling the database each step would slow fast decoding
HEARTBEAT_S = 5.0
STATE_REFRESH_S = 10.0  # the worker-state row's timestamp is at most about this old while the worker lives
STALE_AFTER_S = 60.0  # another worker's run without a heartbeat for this long is taken as abandoned
SWEEP_S = 30.0
DEFAULT_MODEL = "smollm2-135m"  # core.runtime.loading.DEFAULT_MODEL (not imported: importing it loads torch)
# core/tokenswift/step.py's notice, added up front so the UI can say it before the first TokenSwift run.
NO_HEADS_NOTICE = "no trained drafting heads for this model: TokenSwift drafts from n-grams only"


class RunFailed(Exception):
    """A run cannot be generated; the message is for the user."""


@dataclass
class Outcome:
    """What `execute` did with a run: done, cancelled, failed, interrupted (worker stopping), paused (budget spent,
    still running) or lost (someone else ended the run meanwhile)."""

    status: str
    error: str | None = None


@dataclass
class _Job:
    prompt_ids: list[int]
    config: GenerationConfig
    resume_ids: list[int]  # earlier runs' ids + this run's own stored ids
    n_earlier: int  # tokens of earlier runs (not this run's)
    own_before: int  # this run's tokens written by earlier chunks
    step_offset: int  # step rows already stored for this run
    prior_decode_s: float
    prior_prefill_s: float


@dataclass
class _Pending:
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.text or self.ids or self.steps)

    def clear(self) -> None:
        self.text.clear()
        self.ids.clear()
        self.steps.clear()


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def describe_error(e: BaseException) -> str:
    """A one-paragraph message for a failed run (no traceback)."""
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in text.lower():
        return ("Out of memory while generating. Lower max new tokens, shorten the prompt, use the ar method or a "
                "smaller model.")
    if isinstance(e, ValueError):
        return f"Bad settings or prompt: {text or type(e).__name__}."
    if isinstance(e, st.StorageError) or type(e).__module__.startswith("sqlalchemy"):
        return f"Database error: {text}"
    return f"Model error ({type(e).__name__}){': ' + text if text else ''}."


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two model specs name the same model (equal strings, or paths to the same folder/file)."""
    if a == b:
        return True
    if not a or not b:
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


class Worker:
    """Runs queued generation runs on one engine; see the module docstring."""

    def __init__(self, db: st.Database, model: str | None = None, heads: str | Path | None = "default",
                 device: str | None = None, compile: bool | None = False, worker_id: str | None = None,
                 weights: str = "auto",
                 poll_s: float = 0.5, *, engine: Engine | None = None, flush_s: float = FLUSH_S,
                 stale_after_s: float = STALE_AFTER_S, models: Sequence[str] = ()):
        self.db = db
        self.model = model or os.environ.get("TOKENSWIFT_MODEL") or DEFAULT_MODEL
        if engine is not None:
            self.model = model or engine.loaded.name
        self.heads = heads
        # Its own model and heads, and the other models it loads when a run asks for one (app.model_offers: a
        # published checkpoint brings its own heads).
        self.own = (self.model, heads)
        self.models = tuple(m for m in models if not same_model(m, self.model))
        self.device = device
        self.weights = weights
        self.compile = compile
        self.worker_id = worker_id or default_worker_id()
        self.poll_s = poll_s
        self.flush_s = flush_s
        self.stale_after_s = stale_after_s
        self.engine: Engine | None = engine
        self.load_error: str | None = None
        self.state = ("stopped", "")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._load_lock = threading.Lock()
        self._busy = threading.Lock()  # one run at a time, whoever calls process_one
        self._state_lock = threading.Lock()
        self._started = False
        self._last_sweep = 0.0
        self._last_state_write = 0.0
        self._compiling: Iterator[None] | None = None  # auto on a CPU: the idle compile's steps (_compile_steps)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> Worker:
        """Run `run_forever` in a daemon thread (loads the model there) and return at once."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self.run_forever, name=f"worker-{self.worker_id}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Ask the worker to stop and wait for its thread; a run in progress is flushed and marked interrupted
        (resumable). Returns whether the thread ended within `timeout`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def request_stop(self) -> None:
        """Ask the loop to stop after the current step (safe from a signal handler); `stop` also waits."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run_forever(self) -> None:
        """Load the model, then claim and run queued runs until `stop()`; returns early if the model fails to
        load (state "failed"). Errors of single runs never end the loop."""
        try:
            self._startup()
        except st.StorageError:
            log.exception("worker %s: could not flag abandoned runs", self.worker_id)
        try:
            self.ensure_engine()
        except RunFailed:
            return  # the state says "failed" with the reason; ensure_engine logged the traceback
        try:
            while not self._stop.is_set():
                try:
                    worked = self.process_one()
                except Exception:  # a database hiccup (e.g. locked longer than the busy timeout): retry later
                    log.exception("worker %s: error outside a run; retrying", self.worker_id)
                    worked = False
                if not worked:
                    self._idle()
                    if self._compiling is not None and not self._stop.is_set():
                        self._compile_step()
                    else:
                        self._stop.wait(self.poll_s)
        finally:
            self._set_state("stopped", "Stopped.", force=True)

    def _startup(self) -> None:
        """Once: flag runs this worker id left running (it was killed with them) and runs of dead workers."""
        if self._started:
            return
        self._started = True
        ids = st.mark_interrupted(self.db, self.worker_id, stale_after_s=self.stale_after_s)
        if ids:
            log.warning("marked runs %s interrupted (left running by a stopped worker)", ids)
        self._last_sweep = time.monotonic()

    def _idle(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep > min(SWEEP_S, self.stale_after_s / 2):
            self._last_sweep = now
            try:
                if ids := st.mark_interrupted(self.db, stale_after_s=self.stale_after_s):
                    log.warning("marked runs %s interrupted (their worker stopped sending heartbeats)", ids)
            except st.StorageError:
                log.exception("stale-run sweep failed")
        if now - self._last_state_write > STATE_REFRESH_S:
            self._set_state("ready", self._message("Idle."), force=True)  # doubles as the idle heartbeat

    # -- state -------------------------------------------------------------------------------------------------

    def _message(self, activity: str) -> str:
        notices = list(self.engine.notices) if self.engine is not None else []
        return " ".join([activity] + [f"Note: {n[:1].upper()}{n[1:]}." for n in notices])

    def _set_state(self, state: str, message: str, force: bool = False) -> None:
        with self._state_lock:
            if not force and (state, message) == self.state:
                return
            self.state = (state, message)
            try:
                st.set_worker_state(self.db, self.worker_id, state, message, model=self.model, pid=os.getpid())
                self._last_state_write = time.monotonic()
            except Exception:  # a locked or unreachable database must not stop the worker over a status line
                log.exception("could not record worker state %r", state)

    def _refresh_state(self) -> None:
        """Rewrite the current state (same state and message, new timestamp) if it was last written more than
        STATE_REFRESH_S ago: the liveness signal the UI reads. Called from heartbeat threads; never raises."""
        with self._state_lock:
            if time.monotonic() - self._last_state_write < STATE_REFRESH_S:
                return
            state, message = self.state
            try:
                st.set_worker_state(self.db, self.worker_id, state, message, model=self.model, pid=os.getpid())
                self._last_state_write = time.monotonic()
            except Exception:
                log.warning("could not refresh the worker state", exc_info=True)

    # -- the engine ---------------------------------------------------------------------------------------------

    def ensure_engine(self) -> Engine:
        """The engine, loading it on first use (state "loading model", "compiling", then "ready").

        Raises RunFailed with the reason if loading failed (now or before); the state is then "failed".
        """
        with self._load_lock:
            if self.engine is not None:
                return self.engine
            if self.load_error is not None:
                raise RunFailed(self.load_error)
            self._set_state("loading model", f"Loading {self.model}…")
            try:
                with _Ticker(self._refresh_state, HEARTBEAT_S, name="state-heartbeat"):  # loads can take minutes
                    engine = self._load()
            except Exception as e:
                self.load_error = f"Could not load model {self.model}: {describe_load_error(e)}"
                log.exception("worker %s: %s", self.worker_id, self.load_error)
                self._set_state("failed", self.load_error)
                raise RunFailed(self.load_error) from e
            self.engine = engine
            self._set_state("ready", self._message("Idle."))
            return engine

    def _new_engine(self, compile: bool) -> Engine:
        from core.engine import Engine

        engine = Engine.load(self.model, heads=self.heads, device=self.device, compile=compile, weights=self.weights)
        if engine.heads is None:
            engine.notice(NO_HEADS_NOTICE)
        return engine

    def _load(self) -> Engine:
        engine = self._new_engine(compile=self.compile is True)
        if self.compile is True:
            # Compile now, under the "compiling" state, rather than inside the first user's run (compiled graphs
            # that were not warmed up are skipped, so without this compiling would not take effect at all).
            self._set_state("compiling", "Compiling the model's graphs (a few minutes)…")
            engine.warm_up(lambda what: self._set_state("compiling", f"Compiling: {what}…"))
        elif self.compile is None and engine.device.type == "cpu" and not engine.model.native:
            self._compiling = self._compile_steps()  # a native model has nothing to compile
        return engine

    def _compile_step(self) -> None:
        """Auto mode on a CPU model on PyTorch's operators: one step of building the compiled engine while the queue
        is empty (_compile_steps). Graphs cannot compile beside a run: tracing patches torch's module calls
        process-wide and broke an eager forward in another thread (and the GIL slowed that run badly while it
        lasted). A run queued meanwhile starts when the current step ends and runs eagerly until the swap."""
        assert self._compiling is not None and self.engine is not None
        with self._busy, _Ticker(self._refresh_state, HEARTBEAT_S, name="compile-heartbeat"):
            try:
                next(self._compiling)
            except StopIteration:
                self._compiling = None
            except Exception as e:
                log.exception("worker %s: compiling failed; runs stay eager", self.worker_id)
                self._compiling = None
                self.engine.notice(f"the model's graphs did not compile ({describe_load_error(e)}): "
                                   "runs are decoded eagerly")
                self._set_state("ready", self._message("Idle."))

    def _compile_steps(self) -> Iterator[None]:
        """Load a second copy of the model for compiling, then compile one graph a step (~1 min each on 2 cores),
        then swap the compiled engine in; the loop runs queued runs between steps."""
        assert self.engine is not None
        self._set_state("ready", self._message("Idle. Preparing compiled graphs for faster runs…"))
        check_room_to_compile(self.engine.model)
        compiled = self._new_engine(compile=True)
        yield
        for what, compile_graph in compiled.warm_up_plan():
            self._set_state("ready", self._message(f"Idle. Compiling {what} for faster runs…"))
            compile_graph()
            yield
        self.engine = compiled  # the eager engine's weights are freed with it
        log.info("worker %s: compiled graphs ready; runs from now on use them", self.worker_id)
        self._set_state("ready", self._message("Idle."))

    # -- the queue ----------------------------------------------------------------------------------------------

    def process_one(self, time_budget_s: float | None = None) -> bool:
        """Continue this worker's paused run, else claim the oldest queued run; run it (for at most
        `time_budget_s` seconds of generation, then pause it). Returns False if there was nothing to do."""
        with self._busy:
            self.ensure_engine()
            self._startup()
            run = self._own_paused_run() or st.claim_next_run(self.db, self.worker_id)
            if run is None:
                return False
            error = self._serve(run.model)
            if error is None:
                self.execute(run, time_budget_s)
            else:
                self._finish(run, "failed", error)
            return True

    def _serve(self, model: str) -> str | None:
        """Load `model` if a run asks for it and this worker offers it (its own model or one of `models`); the
        reason if it fails to load, after which the worker goes back to its own model (loaded for the next run)."""
        if same_model(model, self.model) or not any(same_model(model, m) for m in (self.own[0], *self.models)):
            return None  # the one loaded, or one this worker does not offer: _prepare says so
        log.info("worker %s: switching from %s to %s", self.worker_id, self.model, model)
        with self._load_lock:
            self.engine, self._compiling, self.load_error = None, None, None
            self.model = model
            self.heads = self.own[1] if same_model(model, self.own[0]) else "default"
        _free_memory()  # the old weights', before the new ones load
        try:
            self.ensure_engine()
            return None
        except RunFailed as e:
            with self._load_lock:
                self.engine, self.load_error = None, None
                self.model, self.heads = self.own
            return str(e)

    def _own_paused_run(self) -> st.Run | None:
        for active in st.active_runs(self.db):
            if active.status == "running" and active.worker_id == self.worker_id:
                return st.get_run(self.db, active.id)
        return None

    def execute(self, run: st.Run, time_budget_s: float | None = None) -> Outcome:
        """Generate a claimed (running) run, persisting as it goes; never raises for the run's own failures."""
        deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        label = f"Generating run {run.id}" + (f" (chapter {run.chapter_id})" if run.chapter_id else "") + "."
        self._set_state("ready", self._message(label))
        try:
            try:
                if st.is_cancel_requested(self.db, run.id):  # cancelled between claim and start, or between chunks
                    return self._finish(run, "cancelled")
                job = self._prepare(run)
            except RunFailed as e:
                return self._finish(run, "failed", str(e))
            except Exception as e:
                log.exception("run %s: could not be prepared", run.id)
                return self._finish(run, "failed", describe_error(e))
            try:
                outcome = self._generate(run, job, deadline)
            except Exception as e:  # a bug in the bookkeeping: still end the run rather than leave it running
                log.exception("run %s: unexpected error", run.id)
                return self._finish(run, "failed", describe_error(e))
            if outcome.status == "done" and run.chapter_id is not None and run.mode in CHAPTER_MODES:
                self._queue_summary(run)
            if outcome.status == "done" and run.comparison_id is not None:
                self._explain_divergence(run.comparison_id)
            return outcome
        finally:
            self._set_state("ready", self._message("Idle."))

    def _queue_summary(self, run: st.Run) -> None:
        """After a chapter run: the chapter's summary, written by the model (where the project wants one)."""
        try:
            summary = queue_summary(self.db, run.chapter_id, run.settings, model=run.model, heads=run.heads,
                                    context=self.engine.max_context if self.engine else None, auto=True)
        except (ValueError, st.StorageError) as e:  # the chapter went meanwhile, or its settings are unusable
            log.warning("run %s: no summary queued for its chapter: %s", run.id, e)
            return
        if summary is not None:
            log.info("run %s: summary run %s queued for chapter %s", run.id, summary.id, run.chapter_id)

    def _explain_divergence(self, comparison_id: int) -> None:
        """After a comparison is settled with runs that differ: vanilla decoding's draw where they first differ
        (the top-2 gap there, core/generation/divergence.py), recomputed once with this engine and stored. From the
        vanilla run's prompt and settings, whichever run finished last. A failure is logged and leaves it unstored:
        the comparison's verdict stands without it."""
        try:
            comparison = st.get_comparison(self.db, comparison_id)
            if comparison.tokens_match is not False or comparison.divergence:
                return  # identical, not settled yet (the other run's worker will do it), or done already
            assert self.engine is not None and comparison.ar_run_id and comparison.tokenswift_run_id
            from core.generation.divergence import explain_divergence
            from core.generation.text import encode_prompt

            ar = st.get_run(self.db, comparison.ar_run_id)
            config = generation_config(validate_settings(user_settings(ar.settings), context=self.engine.max_context),
                                       "ar")
            prompt_ids = encode_prompt(self.engine.tokenizer, ar.prompt or comparison.prompt)
            ar_ids = st.get_run_token_ids(self.db, ar.id)
            ts_ids = st.get_run_token_ids(self.db, comparison.tokenswift_run_id)
            self._set_state("ready", self._message(f"Finding where comparison {comparison_id}'s runs differ."))
            with _Ticker(self._refresh_state, HEARTBEAT_S, name=f"divergence-{comparison_id}"):  # a long prefill
                found = explain_divergence(self.engine, prompt_ids, config, ar_ids, ts_ids)
            if found is not None:
                st.set_comparison_divergence(self.db, comparison_id, found.to_dict())
                log.info("comparison %s: runs differ at token %s, top-2 gap %s", comparison_id, found.position,
                         found.gap)
        except Exception:
            log.exception("comparison %s: where its runs differ could not be recomputed", comparison_id)

    def _finish(self, run: st.Run, status: str, error: str | None = None, **timings: float) -> Outcome:
        try:
            ended = st.finish_run(self.db, run.id, status, error, **timings)
        except st.StorageError:
            log.exception("run %s: could not be marked %s", run.id, status)
            return Outcome("lost", error)
        if ended.status != status:  # someone else (e.g. a stale-run sweep) ended it first
            return Outcome("lost", ended.error)
        log.info("run %s: %s%s", run.id, status, f" ({error})" if error else "")
        return Outcome(status, error)

    # -- one run --------------------------------------------------------------------------------------------------

    def _prepare(self, run: st.Run) -> _Job:
        """Settings, prompt and earlier token ids of a run; RunFailed with a readable reason if unusable."""
        engine = self.engine
        assert engine is not None
        if not same_model(run.model, self.model):
            raise RunFailed(f"This run asks for model {run.model!r}, but this worker serves {self.model!r}. "
                            "Queue it again for the model that is loaded.")
        if not run.settings:
            raise RunFailed("This run has no generation settings (they are missing or damaged in the database). "
                            "Queue it again.")
        try:
            settings = validate_settings(user_settings(run.settings), context=engine.max_context)
            config = generation_config(settings, run.method)
        except ValueError as e:
            raise RunFailed(f"Bad settings: {e}") from None

        try:
            chain = resume_chain(self.db, run)
            earlier = [t for r in chain for t in st.get_run_token_ids(self.db, r.id)]
            own = st.get_run_token_ids(self.db, run.id)  # non-empty only when continuing a paused chunked run
        except (ValueError, st.StorageError) as e:
            raise RunFailed(f"The earlier output cannot be resumed: {e}") from None
        if run.mode == "resume" and not earlier:
            raise RunFailed("Nothing to resume: the earlier run wrote no tokens.")
        # A resume must see exactly the prompt the first run saw; app.jobs copies it, storage callers may not.
        prompt = run.prompt or (chain[0].prompt if chain else None) or self._build_prompt(run, settings)
        try:
            from core.generation.text import encode_prompt

            prompt_ids = encode_prompt(engine.tokenizer, prompt)
        except ValueError as e:
            raise RunFailed(f"The prompt cannot be used: {e}.") from None
        if len(prompt_ids) + config.max_new_tokens > engine.max_context:
            raise RunFailed(f"The prompt ({len(prompt_ids):,} tokens) and max new tokens "
                            f"({config.max_new_tokens:,}) exceed the model's context of {engine.max_context:,} "
                            "tokens. Lower max new tokens or shorten the prompt.")

        resume_ids = earlier + own
        if len(resume_ids) >= config.max_new_tokens:
            raise RunFailed(f"Nothing to resume: {len(resume_ids):,} of {config.max_new_tokens:,} tokens are "
                            "already written.")
        offset, prior_decode_s = 0, 0.0
        if own:
            steps = st.get_steps(self.db, run.id)
            offset = steps[-1].step + 1 if steps else 0
            prior_decode_s = sum(s.step_ms for s in steps) / 1000
        return _Job(prompt_ids, config, resume_ids, len(earlier), len(own), offset, prior_decode_s,
                    run.prefill_s or 0.0)

    def _build_prompt(self, run: st.Run, settings: dict[str, Any]) -> str:
        """Build a chapter or summary run's prompt now (the earlier chapters may have been written since it was
        queued) and save it in the run, so a later resume or chunk uses exactly the same text."""
        engine = self.engine
        assert engine is not None
        chapter_id = run.summary_of if run.mode == "summary" else run.chapter_id
        if chapter_id is None:
            raise RunFailed("This run has no prompt and no chapter (was the chapter deleted?).")
        try:
            chapter = st.get_chapter(self.db, chapter_id)
            project = st.get_project(self.db, chapter.project_id)
            budget = prompt_budget(engine.max_context, settings["max_new_tokens"])
            if run.mode == "summary":
                prompt, info = summary_prompt(project, chapter, engine.tokenizer, budget), None
            else:
                chapters = st.list_chapters(self.db, chapter.project_id, with_text=True)
                built = build_chapter_prompt(project, chapters, chapter, engine.tokenizer, budget, mode=run.mode,
                                             lore=st.list_lore(self.db, project.id))
                prompt, info = built.text, built.report.as_dict()
        except st.NotFoundError as e:
            raise RunFailed(f"The chapter to write is gone: {e}") from None
        except ValueError as e:
            raise RunFailed(f"The prompt does not fit: {e}.") from None
        st.set_run_prompt(self.db, run.id, prompt, info)
        return prompt

    def _generate(self, run: st.Run, job: _Job, deadline: float | None) -> Outcome:
        engine = self.engine
        assert engine is not None
        n_resume = len(job.resume_ids)
        tracker = RepetitionTracker(tokens=job.resume_ids[-REPETITION_WINDOW:])
        pending = _Pending()
        cancel = _CancelCheck(self.db, run.id, self._stop)
        try:
            gen = engine.generate(job.prompt_ids, job.config, cancel=cancel, resume_ids=job.resume_ids)
        except Exception as e:
            log.exception("run %s: the engine refused it", run.id)
            return self._finish(run, "failed", describe_error(e))
        last_flush = 0.0  # the first step is flushed at once: the UI shows text right after the prefill

        def progress() -> dict[str, float]:
            own_tokens = job.own_before + gen.n_out - n_resume
            own_steps = job.step_offset + len(gen.steps)
            decode_s = job.prior_decode_s + gen.decode_s
            return {"prefill_s": job.prior_prefill_s + gen.prefill_s,
                    "tokens_per_s": own_tokens / decode_s if decode_s > 0 else 0.0,
                    "mean_accepted": own_tokens / own_steps if own_steps else 0.0}

        def flush() -> None:
            nonlocal last_flush
            if pending:
                st.append_output(self.db, run.id, "".join(pending.text), pending.ids, pending.steps, **progress())
                pending.clear()
            last_flush = time.monotonic()

        paused = False
        steps = iter(gen)
        try:
            with _Heartbeat(self.db, run.id, HEARTBEAT_S, on_beat=self._refresh_state):
                for step in steps:
                    pending.text.append(step.text)
                    pending.ids.extend(step.token_ids)
                    p = progress()
                    pending.steps.append({
                        "step": job.step_offset + step.index, "new_tokens": len(step.token_ids),
                        "step_ms": step.seconds * 1000, "tokens_so_far": step.n_tokens - job.n_earlier,
                        "accepted": step.accepted, "from_ngram": step.from_ngram, "tree_size": step.tree_size,
                        "tokens_per_s": p["tokens_per_s"], "repetition": tracker.extend(step.token_ids)})
                    if time.monotonic() - last_flush >= self.flush_s:
                        flush()
                    if deadline is not None and time.monotonic() >= deadline and not gen.stop_reason:
                        paused = True
                        break
                steps.close()  # type: ignore[attr-defined]
                # A run that ends early (stopped, interrupted, failed) can be resumed, so the bytes of a character
                # it left unfinished (U+FFFD) are not stored as text: the resume's stream is seeded with
                # these ids and writes the whole character, keeping the chapter equal to the decoded ids.
                flush()
        except st.StorageError as e:
            if st.get_run(self.db, run.id).status != "running":  # cancelled-and-ended, or flagged interrupted
                log.warning("run %s ended elsewhere while generating: %s", run.id, e)
                return Outcome("lost", str(e))
            log.exception("run %s: could not save its output", run.id)
            return self._finish(run, "failed", describe_error(e))
        except Exception as e:
            log.exception("run %s failed while generating", run.id)
            _release_memory(e)
            try:
                flush()  # keep what was written before the error (it can be resumed)
            except Exception:
                log.exception("run %s: could not save its last output", run.id)
            return self._finish(run, "failed", describe_error(e), **_timings(progress(), job, gen))
        if paused:
            return Outcome("paused")
        timings = _timings(progress(), job, gen)
        if gen.stop_reason == "cancelled":
            if cancel.by_stop:
                return self._finish(run, "interrupted", "Interrupted: the worker was stopped; resume to finish it.",
                                    **timings)
            return self._finish(run, "cancelled", **timings)
        return self._finish(run, "done", **timings)


def _timings(progress: dict[str, float], job: _Job, gen: Any) -> dict[str, float]:
    # Decode time of the whole run, chunks included; finish_run derives tokens/s from it.
    return {"prefill_s": progress["prefill_s"], "decode_s": job.prior_decode_s + gen.decode_s}


def _release_memory(e: BaseException) -> None:
    if type(e).__name__ == "OutOfMemoryError":
        _free_memory()


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_room_to_compile(model: torch.nn.Module) -> None:
    """Raise MemoryError unless a compiled engine fits beside `model`: its plain weights plus inductor's prepacked
    copy of them (frozen constants), about twice the model. Running out would kill the process, not raise."""
    import itertools

    import psutil

    size = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    need, free = 2.5 * size, psutil.virtual_memory().available  # 2x, plus room for the graphs' work buffers
    if free < need:
        raise MemoryError(f"compiling needs ~{need / 2**30:.1f} GiB free beside the loaded model, "
                          f"{free / 2**30:.1f} GiB are")


def describe_load_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0][:500] if str(e).strip() else type(e).__name__
    if type(e).__name__ in ("ModelLoadError", "HeadsError"):
        return text
    if isinstance(e, ImportError):
        return f"a component is missing ({text})"
    return describe_error(e) if type(e).__name__ == "OutOfMemoryError" else f"{type(e).__name__}: {text}"


def generation_config(settings: dict[str, Any], method: str) -> GenerationConfig:
    """core's GenerationConfig for normalized settings (app.jobs.validate_settings), validated by core."""
    from core.generation.decoding import GenerationConfig
    from core.generation.sampling import SamplingSettings

    sampling = SamplingSettings.from_dict(settings)
    return GenerationConfig(max_new_tokens=settings["max_new_tokens"], method=method, sampling=sampling,
                            ignore_eos=settings["ignore_eos"]).validate()


class _CancelCheck:
    """The `cancel=` callable: the worker is stopping, or (polled at most every CANCEL_CHECK_S) the UI asked."""

    def __init__(self, db: st.Database, run_id: int, stop: threading.Event):
        self.db, self.run_id, self.stop = db, run_id, stop
        self.by_stop = False
        self._next = 0.0

    def __call__(self) -> bool:
        if self.stop.is_set():
            self.by_stop = True
            return True
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + CANCEL_CHECK_S
        try:
            return st.is_cancel_requested(self.db, self.run_id)
        except st.StorageError:
            log.warning("run %s: could not read its cancel flag; going on", self.run_id, exc_info=True)
            return False


class _Ticker:
    """A daemon thread that calls ``beat`` every ``every_s`` seconds for the duration of a ``with`` block."""

    def __init__(self, beat: Callable[[], None], every_s: float, name: str = "ticker"):
        self.beat, self.every_s = beat, every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            self.beat()

    def __enter__(self) -> _Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


class _Heartbeat(_Ticker):
    """A thread that keeps a run's heartbeat fresh while no flush does (long prefill, slow steps, compiling), and
    (``on_beat``) the worker's state row fresh while it generates."""

    def __init__(self, db: st.Database, run_id: int, every_s: float = HEARTBEAT_S,
                 on_beat: Callable[[], None] | None = None):
        super().__init__(self._beat_once, every_s, name=f"heartbeat-{run_id}")
        self.db, self.run_id, self.on_beat = db, run_id, on_beat
        self._run_alive = True

    def _beat_once(self) -> None:
        if self.on_beat is not None:
            self.on_beat()
        if self._run_alive:
            try:
                st.append_output(self.db, self.run_id)  # empty append = heartbeat
            except st.StorageError:
                self._run_alive = False  # the run ended; the main loop finds out on its next flush


# -- command line -------------------------------------------------------------------------------------------------

def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's share), at least 1."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_threads(value: str | None) -> int | None:
    """A thread-count setting: "auto" (or nothing) gives None, else a whole number of at least 1; ValueError
    otherwise."""
    value = (value or "auto").strip().lower()
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"the thread count must be auto or a whole number of at least 1, got {value!r}")
    return int(value)


def _thread_count(value: str) -> int | None:
    try:
        return parse_threads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _stale_after(value: str) -> float:
    seconds = float(value)
    if not seconds > 2 * HEARTBEAT_S:
        raise argparse.ArgumentTypeError(f"must be more than two heartbeats ({2 * HEARTBEAT_S:g} s), got {value}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.worker",
                                description="TokenSwift Studio generation worker: runs queued runs from the database")
    p.add_argument("--db", default=None, help="database file or SQLAlchemy URL (default: $TOKENSWIFT_DB or "
                                              "data/studio.db)")
    p.add_argument("--model", default=None, help="model spec (default: $TOKENSWIFT_MODEL or smollm2-135m)")
    p.add_argument("--heads", default="default",
                   help="drafting heads: 'default' (committed heads of a known model), 'none', or a file")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--weights", default=os.environ.get("TOKENSWIFT_WEIGHTS", "auto"),
                   choices=("auto", "fp32", "bf16", "q8", "q4"),
                   help="weight format (default: $TOKENSWIFT_WEIGHTS, else auto: the file's own)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the model's graphs before the first run; --no-compile: never (default: where a "
                        "CPU model runs on PyTorch's operators, compile them while the queue is empty)")
    p.add_argument("--worker-id", default=None, help="stable id: a restarted worker with the same id flags the "
                                                     "runs it was killed with as interrupted (default: host:pid)")
    p.add_argument("--poll-s", type=float, default=0.5, help="seconds between queue polls when idle")
    p.add_argument("--stale-after-s", type=_stale_after, default=STALE_AFTER_S,
                   help=f"another worker's run without a heartbeat for this long is marked interrupted, so it can "
                        f"be resumed (default {STALE_AFTER_S:g}; heartbeats come every {HEARTBEAT_S:g} s)")
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="CPU threads for torch: a whole number, or auto (default: torch's choice)")
    p.add_argument("--published", action=argparse.BooleanOptionalAction, default=None,
                   help="also load TokenSwift's published checkpoints when a run asks for one (default: on a GPU "
                        "with the Hugging Face hub in reach, as the studio offers them)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    import signal

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        db = st.open_database(args.db)
    except Exception as e:
        print(f"error: cannot open the database: {e}", file=sys.stderr)
        return 2
    heads = None if args.heads == "none" else args.heads
    model = args.model or os.environ.get("TOKENSWIFT_MODEL") or DEFAULT_MODEL
    models: list[str] = []
    if args.published is not False:
        from app.model_offers import PUBLISHED, studio_offers

        models = ([c.hub_id for c in PUBLISHED] if args.published
                  else [o.spec for o in studio_offers(model)])
    worker = Worker(db, model=model, heads=heads, device=args.device, compile=args.compile,
                    worker_id=args.worker_id, poll_s=args.poll_s, weights=args.weights,
                    stale_after_s=args.stale_after_s, models=models)
    # SIGTERM/SIGINT: finish the current step, save the run as interrupted (resumable), exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.request_stop())
    log.info("worker %s (pid %s) on %s, model %s", worker.worker_id, os.getpid(), db.url, worker.model)
    worker.run_forever()
    db.close()
    if worker.load_error:
        print(f"error: {worker.load_error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
