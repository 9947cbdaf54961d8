"""TokenSwift's published checkpoints (core/tokenswift/published.py), on tiny synthetic ones written in exactly their
layout: safetensors with the backbone under Hugging Face names plus `model.medusa_layers.{k}.linear.weight`,
`.input_layernorm.weight`, `.post_layernorm.weight`, a config.json with `medusa_heads: 3` and the rope scaling of
the model it stands for, and a tokenizer. Three kinds: Qwen2.5 (q/k/v biases, tied embeddings), Llama 3.1 (its
llama3 rope scaling) and YaRN Llama 2 (MHA, yarn). Each loads with its heads and no training; the heads compute
what the paper's MedusaModel computes from the tensors; TokenSwift writes vanilla decoding's ids exactly; the rope
scalings match transformers' own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.engine import Engine, find_heads
from core.generation.decoding import GenerationConfig
from core.generation.sampling import PRESETS
from core.runtime.loading import load_model
from core.tokenswift.heads import HeadsError
from core.tokenswift.options import MAX_TREE, TokenSwiftOptions
from core.tokenswift.published import FORMAT, is_published_checkpoint
from core.tokenswift.tree import HEADS
from lossless import assert_lossless

VOCAB = 512
# (transformers config class, its kwargs, the config.json fields the published checkpoint of that kind adds)
KINDS = {
    "qwen2.5": ("Qwen2Config", dict(tie_word_embeddings=True, num_key_value_heads=2),
                {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0,
                 "max_position_embeddings": 32768, "rope_scaling": None}),
    "llama3.1": ("LlamaConfig", dict(tie_word_embeddings=False, num_key_value_heads=2),
                 {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
                  "max_position_embeddings": 131072,
                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    "yarn-llama2": ("LlamaConfig", dict(tie_word_embeddings=False, num_key_value_heads=4),
                    {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0,
                     "max_position_embeddings": 131072,
                     "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                      "finetuned": True}}),
}


def write_checkpoint(folder: Path, kind: str, seed: int = 0, heads: bool = True) -> Path:
    """A tiny random model of `kind` in the published layout (without the heads: its base model)."""
    import transformers

    from core.runtime.loading import DEFAULT_MODEL, load_tokenizer, resolve

    cls, kwargs, published = KINDS[kind]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.3, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**base))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if kwargs["tie_word_embeddings"]:
        state.pop("lm_head.weight")  # one table, stored once (safetensors refuses shared tensors)
    g = torch.Generator().manual_seed(seed + 100)
    for name, tensor in state.items():
        if name.endswith("bias") or "norm" in name:  # transformers initialises these to 0 / 1: make them count
            tensor += 0.1 * torch.randn(tensor.shape, generator=g)
    H = base["hidden_size"]
    config = {**base, **published}
    if heads:
        for k in range(3):
            p = f"model.medusa_layers.{k}."
            state[p + "linear.weight"] = 0.05 * torch.randn(H, H, generator=g)
            state[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
            state[p + "post_layernorm.weight"] = state["model.norm.weight"] * (1 + 0.1 * torch.randn(H, generator=g))
        config["medusa_heads"] = 3
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # bf16, as published
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=1))
    smol, _ = resolve(DEFAULT_MODEL)
    load_tokenizer(smol).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    return {kind: write_checkpoint(root / kind, kind) for kind in KINDS}


def by_hand(folder: Path, h0: torch.Tensor, eps: float = 1e-6) -> list[torch.Tensor]:
    """Each head's logits from the file's tensors, as the paper's MedusaModel computes them: h = h + linear(
    input_layernorm(h)), chained from the pre-final-norm hidden state; logits = lm_head(post_layernorm(h))."""
    t = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    lm_head = t.get("lm_head.weight", t["model.embed_tokens.weight"])

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    out, h = [], h0
    for k in range(3):
        p = f"model.medusa_layers.{k}."
        h = h + rms(h, t[p + "input_layernorm.weight"]) @ t[p + "linear.weight"].T
        out.append(rms(h, t[p + "post_layernorm.weight"]) @ lm_head.T)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_published_checkpoint_loads_with_its_heads(checkpoints, kind: str) -> None:
    folder = checkpoints[kind]
    assert is_published_checkpoint(folder)
    engine = Engine.load(str(folder), device="cpu")  # heads="default": the ones inside
    heads = engine.heads
    assert heads is not None and heads.n_heads == 3 and heads.root is None and heads.meta["format"] == FORMAT
    assert engine.model.native, "the backbone runs on the CPU kernels like any checkpoint"
    if kind == "qwen2.5":
        assert engine.model.cfg.qkv_bias and engine.model.layers[0].wqkv.args[4].abs().sum() > 0
    # the heads compute what the paper's code computes from the tensors; the drafts are the same ids
    h0 = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    plain = load_model(str(folder), device="cpu", native=False)
    plain_heads = find_heads(plain, "default")
    ours_plain = plain_heads.logits(h0, plain.model)
    ours_native = heads.logits(h0, engine.model)
    for k, hand in enumerate(by_hand(folder, h0)):
        torch.testing.assert_close(ours_plain[k], hand, rtol=1e-5, atol=1e-5)  # PyTorch's operators, reordered
        torch.testing.assert_close(ours_native[k], hand, rtol=1e-4, atol=1e-4)  # our kernels' summation order
        assert torch.equal(ours_native[k].topk(3).indices, hand.topk(3).indices), f"head {k + 1} drafts differ"


@pytest.mark.parametrize("kind", KINDS)
def test_the_backbone_computes_what_transformers_computes(checkpoints, kind: str) -> None:
    """Positions past the original context, where the rope scalings (llama3, yarn) change the rotation and yarn
    scales the attention."""
    import transformers

    folder = checkpoints[kind]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(str(folder), device="cpu", native=False).model
    ids = torch.randint(VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9000, 9012)
    with torch.inference_mode():
        want = hf(ids[None], position_ids=positions[None]).logits[0]
        got, _ = ours(ids, positions, ours.new_cache(12))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},
    "yarn-betas": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 16,
                   "beta_slow": 2},
    "linear": {"type": "linear", "factor": 4.0},
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rope", ROPES)
def test_rope_scalings_equal_transformers(tmp_path: Path, rope: str, head_dim: int) -> None:
    """Inverse frequencies and attention factor bit for bit as transformers computes them from the same config.json,
    and the cos / sin rows the decoder uses up to 100K positions."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from core.runtime.model import ModelConfig, Transformer, rope_frequencies

    config = dict(model_type="llama", hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=64, rms_norm_eps=1e-5,
                  rope_theta=500000.0 if rope == "llama3" else 10000.0, max_position_embeddings=131072,
                  rope_scaling=ROPES[rope])
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(hf)
    inv_freq, scale = rope_frequencies(cfg)
    want_freq, want_scale = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    assert torch.equal(inv_freq, want_freq.float()) and scale == want_scale
    # the rows at a few positions up to 100K, against transformers' rotary embedding of this config
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("meta"):
        model = Transformer(cfg)
    model.inv_freq = inv_freq
    model.norm.weight = torch.nn.Parameter(torch.ones(cfg.hidden_size))  # a real device for the rope table
    positions = torch.tensor([0, 1, 4095, 4096, 8191, 8192, 32767, 65536, 99999])
    cos, sin = model.rope(positions)
    want_cos, want_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_tokenswift_with_the_published_heads_is_lossless(checkpoints, monkeypatch, kind: str, mode: str) -> None:
    """Greedy, studio and paper sampling, every draft of every level verified (the widest trees); the heads draft
    every level (no root head), so trees hold their drafts, and some drafts are accepted."""
    from core.tokenswift import step

    options = TokenSwiftOptions(draft_mode=mode, kv_budget=40, tree_budget=10, draft_depth=MAX_TREE,
                                min_draft_score=0.0)
    loaded = load_model(str(checkpoints[kind]), device="cpu")
    engine = Engine(loaded, find_heads(loaded, "default"), options)
    head_nodes = []
    draft_tree = step.draft_tree

    def spy(*args, **kwargs):
        tree = draft_tree(*args, **kwargs)
        head_nodes.append(sum(1 for s in tree.sources if s & HEADS))
        return tree

    monkeypatch.setattr(step, "draft_tree", spy)
    ids = torch.randint(VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    accepted = from_heads = 0
    for preset in ("greedy", "studio", "paper"):
        config = GenerationConfig(max_new_tokens=160, sampling=PRESETS[preset].with_(seed=5), ignore_eos=True)
        _, ts = assert_lossless(engine, ids, config)
        accepted += sum(s.accepted for s in ts.steps)
        from_heads += sum(s.from_heads for s in ts.steps)
    # n-gram chains may outrank them for the 10 nodes, but most trees hold the heads' drafts
    assert sum(n > 0 for n in head_nodes) > 0.8 * len(head_nodes), "the heads rarely drafted"
    assert accepted > 0, "no draft was ever accepted: the tree was not exercised"
    assert from_heads > 0, "no draft of the published heads was ever accepted"


def test_heads_from_a_checkpoint_for_its_base_model(checkpoints, tmp_path: Path) -> None:
    """`--heads FOLDER`: the base model (the same backbone without heads) takes the checkpoint's heads; a checkpoint
    trained on another backbone is refused; the base model alone has no heads by default."""
    kind = "qwen2.5"
    base = write_checkpoint(tmp_path / "base", kind, heads=False)
    assert not is_published_checkpoint(base)
    assert Engine.load(str(base), device="cpu").heads is None
    with_heads = Engine.load(str(base), heads=str(checkpoints[kind]), device="cpu")
    inside = Engine.load(str(checkpoints[kind]), device="cpu")
    for a, b in zip(with_heads.heads.state_dict().values(), inside.heads.state_dict().values()):
        assert torch.equal(a, b)
    other = write_checkpoint(tmp_path / "other", kind, seed=9)
    with pytest.raises(HeadsError, match="fingerprint mismatch"):
        Engine.load(str(base), heads=str(other), device="cpu")
    with pytest.raises(HeadsError, match="neither a heads file"):
        Engine.load(str(base), heads=str(base), device="cpu")
