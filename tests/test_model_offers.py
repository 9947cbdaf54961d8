"""Models a studio offers (app.model_offers): the published checkpoints only on a GPU with the hub in reach, with
what they need in memory; a worker that loads the model a run asks for and goes back to its own; the UI's picker
(only models on offer, Resume with the model that wrote the run)."""
from __future__ import annotations

import shutil

import gradio as gr
import pytest

import storage as st
from app import model_offers
from app.jobs import PROMPT_RESERVE, queue_chapter_run
from app.live import View
from app.model_offers import PUBLISHED, Offer, offers
from app.ui import Handlers, StudioContext, build_ui
from app.worker import Worker
from conftest import make_tiny_checkpoint

GIB = 2**30


def test_published_checkpoints_are_offered_on_a_gpu_with_the_hub_only():
    own = "smollm2-135m"
    assert [o.spec for o in offers(own, cuda=False, hub=True)] == [own]
    assert [o.spec for o in offers(own, cuda=True, hub=False)] == [own]
    every = offers(own, cuda=True, hub=True)
    assert every[0].spec == own and len(every) == 1 + len(PUBLISHED)
    assert every[1].spec == "TokenSwift/TokenSwift-Qwen2.5-1.5B"  # smallest first
    llama = next(c for c in PUBLISHED if c.hub_id.endswith("Llama-3.1-8B"))
    # Llama-3.1-8B's config: 32 layers, 8 KV heads of 128: 128 KiB of bf16 keys and values a token.
    assert llama.kv_bytes_per_token == 128 * 1024
    assert next(o.label for o in every if o.spec == llama.hub_id) == (
        "TokenSwift Llama-3.1-8B · 15 GiB of bf16 weights + 12.2 GiB of KV cache at 100K tokens")
    on_40 = [o.spec for o in offers(own, cuda=True, hub=True, gpu_bytes=40 * GIB)]
    assert "TokenSwift/TokenSwift-Qwen2.5-14B" in on_40 and "TokenSwift/TokenSwift-QwQ-32B" not in on_40


def test_no_hub_no_offers(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not model_offers.hub_reachable()
    assert [o.spec for o in model_offers.studio_offers("smollm2-135m", gpu=True)] == ["smollm2-135m"]


@pytest.fixture
def two_models(tiny_model_dir, tmp_path):
    other = make_tiny_checkpoint(tmp_path / "other", seed=1)
    return str(tiny_model_dir), str(other)


def chapter(db):
    project = st.create_project(db, "Offers")
    st.update_project(db, project.id, auto_summary=False)
    return st.add_chapter(db, project.id, "One", "Begin.")


def test_a_worker_loads_the_model_a_run_asks_for_and_returns_to_its_own(db, two_models, one_thread, tmp_path):
    own, other = two_models
    w = Worker(db, model=own, heads=None, device="cpu", models=[other], worker_id="w")
    settings = {"max_new_tokens": 8, "method": "tokenswift", "seed": 1}
    first = chapter(db)

    run = queue_chapter_run(db, first.id, "generate", settings, model=other)
    assert w.process_one()
    assert st.get_run(db, run.id).status == "done" and w.engine.loaded.name == other == w.model
    assert w.heads == "default"  # an offered model brings its own heads (none in this tiny one)
    assert st.get_worker_states(db)[0].model == other

    run = queue_chapter_run(db, first.id, "continue", settings, model=own)
    assert w.process_one()
    assert st.get_run(db, run.id).status == "done" and w.engine.loaded.name == own and w.heads is None

    stranger = str(tmp_path / "not-offered")
    run = queue_chapter_run(db, first.id, "continue", settings, model=stranger)
    assert w.process_one()
    failed = st.get_run(db, run.id)
    assert failed.status == "failed" and "asks for model" in failed.error and w.model == own

    shutil.rmtree(other)  # an offered model that cannot load: the run fails, the worker keeps serving its own
    run = queue_chapter_run(db, first.id, "continue", settings, model=other)
    assert w.process_one()
    failed = st.get_run(db, run.id)
    assert failed.status == "failed" and "Could not load model" in failed.error
    run = queue_chapter_run(db, first.id, "continue", settings, model=own)
    assert w.process_one() and st.get_run(db, run.id).status == "done" and w.model == own


def test_the_ui_queues_only_models_on_offer(db, two_models):
    own, other = two_models
    offer = (Offer(own, "own"), Offer(other, "other"))
    demo = build_ui(StudioContext(db=db, model=own, offers=offer))
    pickers = [b for b in demo.blocks.values() if isinstance(b, gr.Dropdown) and b.elem_id in ("write-model",
                                                                                                "compare-model")]
    assert len(pickers) == 2 and pickers[0].choices == [("own", own), ("other", other)]
    h = Handlers(StudioContext(db=db, model=own, heads="default", offers=offer))
    with gr.Blocks():
        from app import settings_panel

        h.write_panel = settings_panel.build("write", models=offer)
    assert h.write_panel.names[0] == "model"
    view = View()
    h.create_project(view, "Picked", "novel", "")
    base = {"max_new_tokens": 8, "seed": 1}
    h.queue_run("generate", view, view.project_id, view.chapter_id, None, None, None, model=other, **base)
    run = st.latest_run_for_chapter(db, view.chapter_id)
    assert (run.model, run.heads) == (other, "default")
    with pytest.raises(gr.Error, match="does not offer the model"):
        h.queue_run("continue", view, view.project_id, view.chapter_id, None, None, None, model="evil/model", **base)
    # Resume continues with the model that wrote the run, whatever the picker shows.
    st.request_cancel(db, run.id)
    running = st.start_chapter_run(db, view.chapter_id, "generate", method="tokenswift", model=other,
                                   settings={**base, "method": "tokenswift", "max_new_tokens": 64})
    st.claim_next_run(db, "w")
    st.set_run_prompt(db, running.id, "The prompt.")
    st.append_output(db, running.id, "Some text", [1, 2])
    st.finish_run(db, running.id, "interrupted")
    h.queue_run("resume", view, view.project_id, view.chapter_id, None, None, None, model=own, **base)
    resumed = st.latest_run_for_chapter(db, view.chapter_id)
    assert resumed.mode == "resume" and resumed.model == other


def test_each_models_context_bounds_its_runs(db, tiny_model_dir, tmp_path):
    """A run may be as long as its own model's context allows (less the prompt's reserve), read from the model's
    configuration at start: the panels' bound is the longest on offer, and each model's own is checked when queued."""
    from core.runtime.loading import DEFAULT_MODEL, model_context, read_config, resolve

    own = str(tiny_model_dir)
    long = str(make_tiny_checkpoint(tmp_path / "long", seed=1, max_position_embeddings=16384))
    contexts = {spec: model_context(spec) for spec in (own, long)}
    assert contexts == {own: 4096, long: 16384}
    assert model_context(DEFAULT_MODEL) == read_config(resolve(DEFAULT_MODEL)[0]).max_position_embeddings == 8192
    assert model_context("nobody/not-downloaded") is None and model_context(str(tmp_path / "x.gguf")) is None

    offer = (Offer(own, "own"), Offer(long, "long"))
    demo = build_ui(StudioContext(db=db, model=own, offers=offer, contexts=contexts))
    bounds = [b.maximum for b in demo.blocks.values() if getattr(b, "elem_id", None) in ("write-max_new_tokens",
                                                                                          "compare-max_new_tokens")]
    assert bounds == [16384 - PROMPT_RESERVE] * 2
    h = Handlers(StudioContext(db=db, model=own, offers=offer, contexts=contexts))
    view = View()
    h.create_project(view, "Long", "novel", "")
    h.queue_run("generate", view, view.project_id, view.chapter_id, None, None, None, model=long,
                max_new_tokens=10_000, seed=1)
    run = st.latest_run_for_chapter(db, view.chapter_id)
    assert (run.model, run.settings["max_new_tokens"]) == (long, 10_000)
    st.request_cancel(db, run.id)
    with pytest.raises(gr.Error, match="between 1 and 3,584 .the model.* context is 4,096 tokens"):
        h.queue_run("generate", view, view.project_id, view.chapter_id, None, None, None, model=own,
                    max_new_tokens=10_000, seed=1)
    # Unknown here (a model not downloaded yet): the default model's bound, as before; its worker checks the real one.
    unknown = StudioContext(db=db, model="nobody/not-downloaded", contexts={"nobody/not-downloaded": None})
    assert unknown.longest_context() is None


def test_a_hub_models_context_comes_from_its_cache_or_when_asked_from_the_hub(tmp_path, monkeypatch):
    """A hub id's config.json: read from the local hub cache only, unless the caller (a studio whose hub answered)
    asks to fetch it. The hub itself is out of reach here: its download function stands in, serving a real config."""
    import huggingface_hub

    from core.runtime.loading import model_context

    served = make_tiny_checkpoint(tmp_path / "hub", max_position_embeddings=32768) / "config.json"
    asked = []

    def download(repo_id, filename, *, local_files_only=False, **kwargs):
        asked.append((repo_id, filename, local_files_only))
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")
        return str(served)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert model_context("TokenSwift/Some-Model") is None
    assert model_context("TokenSwift/Some-Model", fetch=True) == 32768
    assert asked == [("TokenSwift/Some-Model", "config.json", True), ("TokenSwift/Some-Model", "config.json", False)]
