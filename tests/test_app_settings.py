"""app.py's settings (command line over environment over defaults) and app/zerogpu.py off ZeroGPU (a no-op), plus
the ZeroGPU chunk driver with a stand-in `spaces` package and worker."""
from __future__ import annotations

import importlib.util
import sys
import threading
import types
from pathlib import Path

import pytest

from app import zerogpu

ROOT = Path(__file__).resolve().parents[1]


def load_entry():
    # `import app` is the package app/; the entry script app.py is loaded from its path.
    spec = importlib.util.spec_from_file_location("studio_entry", ROOT / "app.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("studio_entry", module)  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_defaults():
    s = load_entry().parse_settings([], env={})
    assert (s.port, s.db, s.model, s.heads, s.worker, s.compile, s.host) == (
        7860, None, "smollm2-135m", "default", True, False, None)


def test_environment_then_command_line():
    entry = load_entry()
    env = {"GRADIO_SERVER_PORT": "9001", "TOKENSWIFT_DB": "/tmp/x.db", "TOKENSWIFT_MODEL": "env-model",
           "TOKENSWIFT_HEADS": "none", "GRADIO_SERVER_NAME": "0.0.0.0"}
    s = entry.parse_settings([], env=env)
    assert (s.port, s.db, s.model, s.heads, s.host) == (9001, "/tmp/x.db", "env-model", None, "0.0.0.0")
    s = entry.parse_settings(["--port", "7000", "--db", "cli.db", "--model", "cli-model", "--heads", "h.pt",
                              "--no-worker", "--compile"], env=env)
    assert (s.port, s.db, s.model, s.heads, s.worker, s.compile) == (7000, "cli.db", "cli-model", "h.pt", False, True)


def test_help_is_instant_and_mentions_the_options(capsys):
    with pytest.raises(SystemExit):
        load_entry().parse_settings(["--help"], env={})
    out = capsys.readouterr().out
    for option in ("--port", "--db", "--model", "--heads", "--no-worker", "--compile"):
        assert option in out


# -- ZeroGPU --------------------------------------------------------------------------------------------------------

def test_zerogpu_off_without_the_env_var(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert not zerogpu.enabled()

    def fn():
        return 1

    assert zerogpu.gpu(fn) is fn
    assert zerogpu.make_driver(lambda: None) is None


def test_zerogpu_off_without_the_spaces_package(monkeypatch):
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setitem(sys.modules, "spaces", None)  # import spaces -> ImportError
    assert not zerogpu.enabled()
    monkeypatch.setenv("SPACES_ZERO_GPU", "false")
    assert not zerogpu.enabled()


class FakeWorker:
    def __init__(self, chunks: int):
        self.left = chunks
        self.budgets: list[float | None] = []

    def process_one(self, time_budget_s=None) -> bool:
        self.budgets.append(time_budget_s)
        if self.left == 0:
            return False
        self.left -= 1
        return True


def test_chunk_driver_runs_the_queue_in_gpu_calls(monkeypatch):
    calls: list[int] = []
    fake_spaces = types.ModuleType("spaces")

    def GPU(duration=60):  # noqa: N802 - the real decorator's name
        def wrap(fn):
            def inner(*a, **kw):
                calls.append(duration)
                return fn(*a, **kw)
            return inner
        return wrap

    fake_spaces.GPU = GPU
    monkeypatch.setitem(sys.modules, "spaces", fake_spaces)
    monkeypatch.setenv("SPACES_ZERO_GPU", "1")
    assert zerogpu.enabled()
    worker = FakeWorker(chunks=3)
    driver = zerogpu.make_driver(lambda: worker)
    assert driver is not None
    assert driver.drive() == 3
    assert calls == [zerogpu.GPU_DURATION_S] * 4  # three chunks, then one call that found the queue empty
    assert worker.budgets == [zerogpu.CHUNK_S] * 4


def test_only_one_request_drives_at_a_time(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    gate, entered = threading.Event(), threading.Event()

    class SlowWorker:
        def process_one(self, time_budget_s=None):
            entered.set()
            gate.wait(5)
            return False

    driver = zerogpu.ChunkDriver(SlowWorker)
    t = threading.Thread(target=driver.drive)
    t.start()
    entered.wait(5)
    assert driver.drive() == 0  # the second request returns at once
    gate.set()
    t.join(5)
