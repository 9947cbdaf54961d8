"""app.jobs: settings validation (and its agreement with core), queueing chapter runs, resume rules, comparisons."""

import subprocess
import sys

import pytest

import storage as st
from app.jobs import (
    DEFAULT_CONTEXT,
    DEFAULT_SETTINGS,
    LIMITS,
    PROMPT_RESERVE,
    queue_chapter_run,
    queue_comparison,
    resume_chain,
    validate_settings,
)

MODEL = "tiny"


@pytest.fixture
def chapter(db):
    project = st.create_project(db, "Novel", premise="A lighthouse keeper.")
    chapter = st.add_chapter(db, project.id, "Storm")
    st.set_chapter_text(db, chapter.id, "Existing text.")
    return st.get_chapter(db, chapter.id)


def test_jobs_does_not_import_torch():
    code = "import app.jobs, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_defaults_and_limits_agree_with_core():
    from core.generation.decoding import MAX_NEW_TOKENS, GenerationConfig
    from core.generation.sampling import MAX_SEED, PRESETS, SamplingSettings

    studio = PRESETS["studio"].to_dict()
    assert {k: DEFAULT_SETTINGS[k] for k in studio} == {**studio, "seed": 0}
    assert validate_settings({}) == DEFAULT_SETTINGS
    assert LIMITS["seed"][1] == MAX_SEED and LIMITS["max_new_tokens"][1] <= MAX_NEW_TOKENS
    # Every bound the studio accepts is accepted by core too (LIMITS is a subset of core's ranges).
    for name, bounds in LIMITS.items():
        for value in bounds:
            s = validate_settings({name: value})
            sampling = SamplingSettings.from_dict(s).validate()
            GenerationConfig(max_new_tokens=s["max_new_tokens"], sampling=sampling).validate()


def test_validate_normalizes():
    s = validate_settings({"max_new_tokens": 256.0, "temperature": 1, "top_p": "0.5", "seed": None,
                           "method": "ar", "ignore_eos": True})
    assert s["max_new_tokens"] == 256 and isinstance(s["max_new_tokens"], int)
    assert s["temperature"] == 1.0 and isinstance(s["temperature"], float)
    assert (s["top_p"], s["seed"], s["method"], s["ignore_eos"]) == (0.5, 0, "ar", True)


@pytest.mark.parametrize("raw, message", [
    ({"temperature": 2.5}, r"Temperature must be between 0 and 2 \(0 = greedy\), got 2.5"),
    ({"temperature": "hot"}, "Temperature must be a number, got 'hot'"),
    ({"temperature": float("nan")}, "Temperature must be a finite number"),
    ({"top_p": 0}, "Top-p must be between 0.01 and 1"),
    ({"top_k": 2.5}, "Top-k must be a whole number"),
    ({"top_k": True}, "Top-k must be a number, got True"),
    ({"penalty": 0.9}, "Penalty θ must be between 1 and 2"),
    ({"penalty_window": 0}, "Penalty window must be between 1 and 16384"),
    ({"seed": -1}, "Seed must be between 0 and"),
    ({"max_new_tokens": 0}, "Max new tokens must be between 1 and 7,680"),
    ({"max_new_tokens": [5]}, "Max new tokens must be a number, got list"),
    ({"method": "medusa"}, "Method must be one of ar, tokenswift"),
    ({"ignore_eos": "yes"}, "must be true or false"),
    ({"temprature": 0.5}, "Unknown setting.*temprature"),
    ([("temperature", 1)], "Settings must be a mapping"),
])
def test_validate_refuses_with_a_message_naming_the_field(raw, message):
    with pytest.raises(ValueError, match=message):
        validate_settings(raw)


def test_max_new_tokens_must_fit_the_context():
    top = DEFAULT_CONTEXT - PROMPT_RESERVE
    assert validate_settings({"max_new_tokens": top})["max_new_tokens"] == top
    with pytest.raises(ValueError, match="context is 8,192 tokens"):
        validate_settings({"max_new_tokens": top + 1})
    with pytest.raises(ValueError, match="between 1 and 3,584"):
        validate_settings({"max_new_tokens": 4000}, context=4096)
    assert validate_settings({"max_new_tokens": 30_000}, context=32_768)["max_new_tokens"] == 30_000


def test_queue_chapter_run_stores_normalized_settings(db, chapter):
    run = queue_chapter_run(db, chapter.id, "regenerate", {"max_new_tokens": 64, "method": "ar"}, model=MODEL)
    assert (run.status, run.mode, run.method, run.model, run.prompt) == ("queued", "regenerate", "ar", MODEL, None)
    assert run.settings == {**DEFAULT_SETTINGS, "max_new_tokens": 64, "method": "ar"}
    with pytest.raises(ValueError, match="already has a run queued"):
        queue_chapter_run(db, chapter.id, "generate", {}, model=MODEL)


@pytest.mark.parametrize("mode, settings", [
    ("regenerate", {"temperature": 9}), ("generate", {"bogus": 1}), ("rewrite", {}),
])
def test_invalid_requests_touch_nothing(db, chapter, mode, settings):
    with pytest.raises(ValueError):
        queue_chapter_run(db, chapter.id, mode, settings, model=MODEL)
    after = st.get_chapter(db, chapter.id)
    assert (after.text, after.status, after.updated_at) == ("Existing text.", chapter.status, chapter.updated_at)
    assert st.list_runs(db) == [] and st.list_revisions(db, chapter.id) == []


def written_run(db, chapter_id, n_tokens, end="interrupted", prompt="THE PROMPT", **settings):
    """A chapter run that wrote `n_tokens` tokens and then ended as `end`."""
    run = queue_chapter_run(db, chapter_id, "generate", {"max_new_tokens": 100, "seed": 7, **settings}, model=MODEL)
    assert st.claim_next_run(db, "w").id == run.id
    st.set_run_prompt(db, run.id, prompt)
    if n_tokens:
        st.append_output(db, run.id, " x" * n_tokens, list(range(n_tokens)))
    if end == "interrupted":
        st.mark_interrupted(db, "w")
    else:
        st.finish_run(db, run.id, end)
    return st.get_run(db, run.id)


def test_resume_refused_without_a_resumable_run(db, chapter):
    with pytest.raises(ValueError, match="has no run yet"):
        queue_chapter_run(db, chapter.id, "resume", None, model=MODEL)
    written_run(db, chapter.id, 5, end="done")
    with pytest.raises(ValueError, match="latest run is done"):
        queue_chapter_run(db, chapter.id, "resume", None, model=MODEL)
    written_run(db, chapter.id, 0, end="failed")
    with pytest.raises(ValueError, match="wrote no text"):
        queue_chapter_run(db, chapter.id, "resume", None, model=MODEL)
    written_run(db, chapter.id, 5, end="cancelled")
    with pytest.raises(ValueError, match="written by model 'tiny'"):
        queue_chapter_run(db, chapter.id, "resume", None, model="other")
    with pytest.raises(ValueError, match="5 of 4 tokens are already written"):
        queue_chapter_run(db, chapter.id, "resume", {"max_new_tokens": 4}, model=MODEL)
    assert st.latest_run_for_chapter(db, chapter.id).status == "cancelled"  # nothing was queued


def test_resume_reuses_prompt_method_and_settings(db, chapter):
    first = written_run(db, chapter.id, 10, method="ar", temperature=0.3)
    asked = {"max_new_tokens": 300, "temperature": 1.5, "method": "tokenswift"}
    run = queue_chapter_run(db, chapter.id, "resume", asked, model=MODEL, heads="h.safetensors")
    assert (run.mode, run.method, run.prompt, run.heads) == ("resume", "ar", "THE PROMPT", "h.safetensors")
    # Only the length may change: sampling stays the interrupted run's, so the continuation is exact.
    assert run.settings == {**first.settings, "max_new_tokens": 300, "resume_of": first.id}
    assert [r.id for r in resume_chain(db, run)] == [first.id]

    # A resume of a resume that was stopped before writing anything still resumes the whole chain.
    assert st.claim_next_run(db, "w2").id == run.id
    st.finish_run(db, run.id, "cancelled")
    again = queue_chapter_run(db, chapter.id, "resume", None, model=MODEL)
    assert again.settings["resume_of"] == run.id and again.settings["max_new_tokens"] == 300
    assert [r.id for r in resume_chain(db, again)] == [first.id, run.id]


def test_queue_comparison(db):
    comparison = queue_comparison(db, "Write a poem.", {"seed": 3, "method": "ar"}, model=MODEL, heads="h")
    ar, ts = st.get_run(db, comparison.ar_run_id), st.get_run(db, comparison.tokenswift_run_id)
    assert (ar.method, ts.method, ar.heads, ts.heads) == ("ar", "tokenswift", None, "h")
    expected = {k: v for k, v in DEFAULT_SETTINGS.items() if k != "method"} | {"seed": 3}
    assert ar.settings == ts.settings == comparison.settings == expected
    assert ar.prompt == ts.prompt == "Write a poem."
    for prompt, settings, message in [("  ", {}, "prompt cannot be empty"), ("ok", {"top_k": -1}, "Top-k")]:
        with pytest.raises(ValueError, match=message):
            queue_comparison(db, prompt, settings, model=MODEL)
    assert len(st.list_comparisons(db)) == 1
