"""Shared fixtures: the real default model (loaded once per session) and tiny random checkpoints.

The tiny checkpoints are real Hugging Face folders (config, safetensors, the default model's tokenizer) written to a
temporary directory, so anything that takes a model spec — the CLI, the worker in another process — can load them
in a second, and the text they write is real (if meaningless) tokens.
"""
from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint folder (a valid model spec)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smol_engine():
    """The real default model (SmolLM2-135M-Instruct, fp32, CPU) with no heads; shared by the whole session."""
    from core.engine import Engine

    return Engine.load("smollm2-135m", heads=None, device="cpu")
