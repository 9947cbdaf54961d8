"""Shared fixtures: the real default model (loaded once per session) and tiny random checkpoints.

The tiny checkpoints are real Hugging Face folders (config, safetensors, the default model's tokenizer) written to a
temporary directory, so anything that takes a model spec — the CLI, the worker in another process — can load them
in a second, and the text they write is real (if meaningless) tokens.

`studio_server` runs `app.py` (app/studio_process.py) in a subprocess on the tiny model and a temporary
database, for the API and browser tests.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from postgres import PostgresServer, binaries, postgres_server

from app.studio_process import StudioServer, free_port
from app.studio_process import studio_server as app_server

os.environ.setdefault("TOKENSWIFT_CACHE", str(Path.home() / ".cache" / "tokenswift"))


def make_tiny_checkpoint(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a small random model of `arch` (llama, qwen2, mistral) with the default model's tokenizer."""
    import transformers

    from core.runtime.loading import DEFAULT_MODEL, load_tokenizer, resolve

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


def path_tokens(tree, node: int) -> list[int]:
    """Tokens of a candidate tree (core/tokenswift/tree.py) from the root's child down to `node`, root excluded."""
    out: list[int] = []
    while node > 0:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return out[::-1]


@pytest.fixture
def db(tmp_path: Path):
    """A fresh SQLite database file, migrated to the head schema."""
    import storage

    with storage.open_database(tmp_path / "studio.db") as database:
        yield database


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for the session (tests/postgres.py)."""
    if binaries() is None:
        message = "PostgreSQL is not installed: `make postgres` (apt-get install postgresql)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(request: pytest.FixtureRequest, tmp_path: Path):
    """A fresh database migrated to the head schema: a SQLite file, then a new database on the PostgreSQL server."""
    import storage

    url = tmp_path / "studio.db" if request.param == "sqlite" else request.getfixturevalue("postgres").create_database()
    with storage.open_database(url) as database:
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
    """The real default model (SmolLM2-135M-Instruct) as it ships, its GGUF's 4- and 8-bit blocks on our CPU
    kernels, with no heads; shared by the whole session."""
    from core.engine import Engine

    return Engine.load("smollm2-135m", heads=None, device="cpu")


@pytest.fixture(scope="session")
def smol_fp32():
    """The default model dequantized to fp32 on our CPU kernels, with an fp32 KV cache (the engine's is bf16): the
    numbers transformers computes with."""
    import torch

    from core.engine import Engine

    engine = Engine.load("smollm2-135m", heads=None, device="cpu", weights="fp32")
    engine.model.kv_dtype = torch.float32
    return engine


# -- the studio server (tests/test_app_api.py, tests/test_browser.py) ----------------------------------------------

@contextmanager
def studio_server(folder: Path, model_dir: Path, *, db_path: Path | str | None = None, port: int | None = None,
                  args: tuple[str, ...] = ()) -> Iterator[StudioServer]:
    """`app.py` on the tiny model (no heads, eager) with its database in `folder` unless given; stopped after."""
    port = port or free_port()
    with app_server(db_path or folder / "studio.db", folder / f"server-{port}.log", port=port,
                    args=("--model", str(model_dir), "--heads", "none", "--no-compile", *args)) as server:
        yield server


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           tiny_model_dir: Path) -> Iterator[StudioServer]:
    """`app.py` on a fresh database and the tiny model, shared by one test module's tests."""
    with studio_server(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), tiny_model_dir) as s:
        yield s
