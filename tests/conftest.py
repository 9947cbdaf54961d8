"""Shared fixtures: the real default model (loaded once per session) and tiny random checkpoints.

The tiny checkpoints are real Hugging Face folders (config, safetensors, the default model's tokenizer) written to a
temporary directory, so anything that takes a model spec — the CLI, the worker in another process — can load them
in a second, and the text they write is real (if meaningless) tokens.

`studio_server` runs `app.py` in a subprocess on a temporary database, for the API and browser tests.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENSWIFT_CACHE", str(Path.home() / ".cache" / "tokenswift"))


def make_tiny_checkpoint(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a small random model of `arch` (llama, qwen2, mistral) with the default model's tokenizer."""
    import transformers

    from core.loading import DEFAULT_MODEL, load_tokenizer, resolve

    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}
    kwargs = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = classes[arch](**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    smol_folder, _ = resolve(DEFAULT_MODEL)
    load_tokenizer(smol_folder).save_pretrained(folder)
    return folder


@pytest.fixture
def db(tmp_path: Path):
    """A fresh SQLite database file, migrated to the head schema."""
    import storage

    with storage.open_database(tmp_path / "studio.db") as database:
        yield database


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint folder (a valid model spec)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module's engines: with two, torch's threads fight any other process on a small
    machine and run ~20x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smol_engine():
    """The real default model (SmolLM2-135M-Instruct, fp32, CPU) with no heads; shared by the whole session."""
    from core.engine import Engine

    return Engine.load("smollm2-135m", heads=None, device="cpu")


# -- the studio server (tests/test_app_api.py, tests/test_browser.py) ----------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180  # imports + migrations + loading the tiny model, on a busy 2-core machine


@dataclass
class StudioServer:
    url: str
    db_path: Path
    log_path: Path
    proc: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_ready(db_path: Path) -> bool:
    import storage

    if not db_path.exists():
        return False
    with storage.open_database(db_path, migrate=False) as db:
        try:
            return any(s.state == "ready" for s in storage.get_worker_states(db))
        except Exception:  # tables not created yet
            return False


@contextmanager
def studio_server(folder: Path, model_dir: Path, *, db_path: Path | None = None, port: int | None = None,
                  args: tuple[str, ...] = ()) -> Iterator[StudioServer]:
    """Run `python app.py` (on a free port unless given) until the page answers and the worker is ready; stop it
    (SIGTERM) after."""
    port = port or free_port()
    db_path = db_path or folder / "studio.db"
    log_path = folder / f"server-{port}.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "TOKENSWIFT_DB": str(db_path),
           "PYTHONUNBUFFERED": "1"}
    env.pop("GRADIO_SERVER_PORT", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--model", str(model_dir),
                                 "--heads", "none", "--no-compile", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = StudioServer(f"http://127.0.0.1:{port}/", db_path, log_path, proc)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"app.py exited with {proc.returncode}:\n{server.log()}")
            try:
                with urllib.request.urlopen(server.url, timeout=5) as r:
                    if r.status == 200 and _worker_ready(db_path):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"app.py did not become ready in {START_TIMEOUT_S} s:\n{server.log()}")
            time.sleep(0.5)
        yield server
    finally:
        stop_server(server)


def stop_server(server: StudioServer, timeout: float = 40) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)  # graceful: the worker saves its run as interrupted
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           tiny_model_dir: Path) -> Iterator[StudioServer]:
    """`app.py` on a fresh database and the tiny model, shared by one test module's tests."""
    with studio_server(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), tiny_model_dir) as s:
        yield s
