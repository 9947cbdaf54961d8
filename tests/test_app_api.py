"""End to end through the HTTP API: `app.py` in a subprocess (temp database, tiny random model), driven with
gradio_client the way a script would. Create a project, generate, watch text and metrics grow, stop, export; then
restart the server on the same database and find the same text.

The server helpers (`studio_server` and the module-scoped `server` fixture in tests/conftest.py, over
app/studio_process.py) are shared with the browser tests.
"""
from __future__ import annotations

import json
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.studio_process import stop_server
from conftest import make_tiny_checkpoint, studio_server


def wait_for(fn: Callable[[], Any], timeout: float = 90, every: float = 0.5, what: str = "condition") -> Any:
    """Call fn until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(every)


def value_of(update: Any) -> Any:
    """The value inside a component update dict (gradio_client returns updates as dicts)."""
    return update.get("value") if isinstance(update, dict) and update.get("__type__") == "update" else update


def plot_points(plot: Any) -> int:
    """Number of x values in a Plotly figure's first trace (as returned for a gr.Plot output)."""
    data = value_of(plot)
    if isinstance(data, dict) and "plot" in data:
        data = data["plot"]
    if isinstance(data, str):
        data = json.loads(data)
    traces = (data or {}).get("data") or []
    return len(traces[0].get("x") or []) if traces else 0


# Refresh outputs, in order (see app/ui.py WRITE_POLL_OUTPUTS).
WORKER, CHAPTERS, STATUS, TEXT, COUNTS, PLOT_ACC, PLOT_TPS, PLOT_REP = range(8)


@pytest.mark.slow
def test_errors_are_readable_and_sessions_are_separate(server):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    a = Client(server.url, verbose=False)
    b = Client(server.url, verbose=False)
    a.predict(remembered={}, api_name="/load")
    b.predict(remembered={}, api_name="/load")
    with pytest.raises(AppError, match="cannot be empty"):
        a.predict("   ", "novel", "", api_name="/create_project")
    a_project = value_of(a.predict("Alpha", "novel", "Alpha premise", api_name="/create_project")[0])
    b_project = value_of(b.predict("Beta", "report", "Beta premise", api_name="/create_project")[0])
    # Each session acts on its own project: b's save goes to Beta, a's premise stays Alpha's.
    with pytest.raises(AppError, match="greater than maximum"):  # the Number's own limit, from app.jobs.LIMITS
        b.predict(b_project, 0, "Beta premise 2", "Chapter 1", "", max_new_tokens=10**7, api_name="/generate")
    # Within the default model's bound but beyond this model's 4,096-token context less the prompt's reserve: the
    # studio read the context at start, so the Number's own limit is this model's.
    with pytest.raises(AppError, match="greater than maximum value 3584"):
        b.predict(b_project, 0, "Beta premise 2", "Chapter 1", "", max_new_tokens=5000, api_name="/generate")
    b.predict(b_project, 0, "Beta premise 2", "Chapter 1", "", max_new_tokens=8, api_name="/generate")
    wait_for(lambda: "badge-done" in str(b.predict(api_name="/refresh")[STATUS]), what="the short run")
    a_view = a.predict(a_project, api_name="/open_project")
    assert value_of(a_view[3]) == "Alpha premise"
    b_view = b.predict(b_project, api_name="/open_project")
    assert value_of(b_view[3]) == "Beta premise 2"
    # A stale owner id (the page showed another project) is refused rather than written to the wrong project.
    with pytest.raises(AppError, match="switched project"):
        a.predict(b_project, 0, "leak", "Chapter 1", "", "", api_name="/save_chapter")
    assert value_of(a.predict(a_project, api_name="/open_project")[3]) == "Alpha premise"


@pytest.mark.slow
def test_generate_stop_export_restart(server, tmp_path, tiny_model_dir):
    from gradio_client import Client

    client = Client(server.url, verbose=False, download_files=str(tmp_path))
    out = client.predict(remembered={}, api_name="/load")
    assert value_of(out[0]) is None  # no project open yet

    out = client.predict("The <Lighthouse> & Keeper", "novel", "A keeper finds letters.", api_name="/create_project")
    project_id = value_of(out[0])
    assert isinstance(project_id, int)
    assert value_of(out[1]) == "The <Lighthouse> & Keeper"

    # 3,000 tokens written to full length: long enough to watch it grow and stop it midway.
    status = client.predict(project_id, 0, "A keeper finds letters.", "Storm", "Night falls.", method="tokenswift",
                            max_new_tokens=3000, ignore_eos=True, seed=7, api_name="/generate")
    assert "queued" in status or "running" in status

    def refresh() -> tuple:
        return client.predict(api_name="/refresh")

    def running_text() -> tuple | None:
        r = refresh()
        text = value_of(r[TEXT])
        return r if "running" in str(r[STATUS]) and isinstance(text, str) and len(text) > 20 else None

    first = wait_for(running_text, what="the text to appear")
    text1 = value_of(first[TEXT])
    runs = client.predict(all_projects=False, api_name="/history")
    run_id = runs[1]["choices"][0][1]  # the run picker's choices: (label, run id), newest first
    steps1 = client.predict(run_id, api_name="/run_details")[1]["steps"]

    def grown() -> tuple | None:
        r = refresh()
        text = value_of(r[TEXT])
        return r if isinstance(text, str) and len(text) > len(text1) + 20 else None

    second = wait_for(grown, what="the text to grow")
    assert value_of(second[TEXT]).startswith(text1[:20])
    details = wait_for(lambda: (d := client.predict(run_id, api_name="/run_details"))[1]["steps"] > steps1 and d,
                       what="the run's metrics to grow")
    assert details[1]["n_tokens"] > 0 and details[1]["status"] == "running" and details[1]["tokens_per_s"]
    assert plot_points(details[2]) > 0 and plot_points(details[3]) > 0  # tokens/step and throughput charts
    assert plot_points(second[PLOT_TPS]) > 0 or second[PLOT_TPS] is None  # the live chart (None: unchanged)

    client.predict(api_name="/stop")

    def stopped() -> tuple | None:
        r = refresh()
        return r if "stopped" in str(r[STATUS]) or "badge-cancelled" in str(r[STATUS]) else None

    wait_for(stopped, what="the run to stop")
    final = client.predict(run_id, api_name="/run_details")[1]
    assert final["status"] == "cancelled" and 0 < final["n_tokens"] < 3000

    # Full text now (the poll sends only changes: ask a fresh session for everything).
    client2 = Client(server.url, verbose=False, download_files=str(tmp_path))
    out2 = client2.predict(remembered={"project_id": project_id}, api_name="/load")
    chapter_id = out2[18]  # the chapter-owner field (see project_outs in app/ui.py)
    assert isinstance(chapter_id, int) and chapter_id > 0
    full = value_of(client2.predict(api_name="/refresh")[TEXT])
    assert isinstance(full, str) and len(full) >= len(value_of(second[TEXT]))

    md_path = Path(value_of(client.predict("markdown", api_name="/export")))
    md = md_path.read_text(encoding="utf-8")
    assert md.startswith("# The \\<Lighthouse\\> & Keeper")  # escaped in the heading
    assert "## Storm" in md and full.strip()[:30] in md.replace("\\", "")
    epub = Path(value_of(client.predict("epub", api_name="/export")))
    with zipfile.ZipFile(epub) as z:
        assert z.namelist()[0] == "mimetype"
        assert "&lt;Lighthouse&gt; &amp; Keeper" in z.read("OEBPS/title.xhtml").decode()
    txt = Path(value_of(client.predict("text", api_name="/export"))).read_text(encoding="utf-8")
    assert txt.startswith("The <Lighthouse> & Keeper\n")

    # A server restart on the same database shows the same text. (This stops the module's server: keep this test
    # last in the file.)
    stop_server(server)
    with studio_server(tmp_path, tiny_model_dir, db_path=server.db_path) as again:
        client3 = Client(again.url, verbose=False)
        client3.predict(remembered={"project_id": project_id, "chapter_id": chapter_id}, api_name="/load")
        r = client3.predict(api_name="/refresh")
        assert value_of(r[TEXT]) == full
        assert "stopped" in str(r[STATUS])


@pytest.mark.slow
def test_restart_mid_run_then_resume(tmp_path):
    """A server stopped while it writes saves the run as interrupted; after the restart Resume carries on from the
    same text."""
    from gradio_client import Client

    # A run far longer than the test's wait for its first text, so the stop always lands mid-run: a larger tiny model
    # (each step slower, the first flush no later) and a long run.
    model_dir = make_tiny_checkpoint(tmp_path / "slower", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                     max_position_embeddings=8192)
    with studio_server(tmp_path, model_dir) as first:
        client = Client(first.url, verbose=False)
        client.predict(remembered={}, api_name="/load")
        project_id = value_of(client.predict("Resumable", "novel", "A long road.", api_name="/create_project")[0])
        client.predict(project_id, 0, "A long road.", "Chapter 1", "", method="tokenswift", max_new_tokens=7000,
                       ignore_eos=True, api_name="/generate")
        wait_for(lambda: len(value_of(client.predict(api_name="/refresh")[TEXT]) or "") > 100 or None,
                 what="some text")
    # `first` got SIGTERM: its worker saved the run as interrupted.
    with studio_server(tmp_path, model_dir, db_path=first.db_path) as second:
        client = Client(second.url, verbose=False)
        client.predict(remembered={"project_id": project_id}, api_name="/load")
        r = client.predict(api_name="/refresh")
        assert "interrupted" in r[STATUS] and "Resume" in r[STATUS]
        before = value_of(r[TEXT])
        status = client.predict(0, 0, "A long road.", "Chapter 1", "", api_name="/resume")
        assert "Resume" in status

        def longer() -> str | None:
            text = value_of(client.predict(api_name="/refresh")[TEXT])
            return text if isinstance(text, str) and len(text) > len(before) + 50 else None

        assert wait_for(longer, what="the resumed text").startswith(before)
        client.predict(api_name="/stop")
