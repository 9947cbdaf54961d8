"""The runtime's logits equal transformers' own implementation of the same weights (fp32, relative error < 1e-4):
prefill, one-token step, and a multi-token step under a non-causal tree mask, on tiny random Llama / Qwen2 / Mistral
models (MHA and GQA, rope scalings) and on the real SmolLM2 weights."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import path_tokens
from core.runtime.model import ModelConfig, build_model
from core.tokenswift.tree import TreeBuilder

TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def tiny_hf(arch: str, kv_heads: int, **extra) -> transformers.PreTrainedModel:
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}
    cfg = classes[arch](vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                        tie_word_embeddings=arch == "qwen2", **extra)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF leaves biases at zero; make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def sample_tree(prefix_len: int, vocab: int) -> tuple[list[int], TreeBuilder]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(vocab, (prefix_len + 1,), generator=g).tolist()
    builder = TreeBuilder(tokens[-1])
    for _ in range(5):  # several random branches, some sharing prefixes
        path = torch.randint(4, (3,), generator=g).tolist()
        builder.add([10 + t for t in path], [0.5, 0.4, 0.3], 1)
    return tokens, builder


def check_against_hf(hf: transformers.PreTrainedModel, vocab: int) -> None:
    cfg = ModelConfig.from_hf(hf.config)
    ours = build_model(cfg, hf.state_dict())
    tokens, builder = sample_tree(40, vocab)
    prefix, root = tokens[:-1], tokens[-1]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
        cache = ours.new_cache(128)
        # prefill in two chunks, then the root as a one-token step
        l1, _ = ours(torch.tensor(prefix[:25]), torch.arange(25), cache)
        cache.commit()
        l2, _ = ours(torch.tensor(prefix[25:]), torch.arange(25, len(prefix)), cache)
        cache.commit()
        assert rel_err(torch.cat([l1, l2]), ref[:-1]) < TOL
        l3, _ = ours(torch.tensor([root]), torch.tensor([len(prefix)]), cache)
        cache.commit()
        assert rel_err(l3[0], ref[-1]) < TOL
        # a token tree after the root: node i must see exactly its ancestors
        tree = builder.build(16)
        nodes = tree.tokens[1:]
        mask = tree.mask()[1:, 1:]
        positions = tree.positions(len(prefix))[1:]
        lt, _ = ours(torch.tensor(nodes), positions, cache, mask)
        for i in range(len(nodes)):
            path_ids = tokens + path_tokens(tree, i + 1)
            expect = hf(torch.tensor([path_ids])).logits[0, -1]
            assert rel_err(lt[i], expect) < TOL, f"tree node {i}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_tiny_models_match_transformers(arch: str, kv_heads: int) -> None:
    check_against_hf(tiny_hf(arch, kv_heads), 256)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
], ids=["llama3", "yarn", "linear"])
def test_rope_scalings_match_transformers(scaling: dict) -> None:
    check_against_hf(tiny_hf("llama", 2, rope_parameters=scaling), 256)


def test_mistral_sliding_window_matches_transformers() -> None:
    hf = tiny_hf("mistral", 2, sliding_window=16)
    hf.config._attn_implementation = "eager"
    cfg = ModelConfig.from_hf(hf.config)
    ours = build_model(cfg, hf.state_dict())
    ids = torch.randint(256, (50,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        cache = ours.new_cache(64)
        a, _ = ours(ids[:40], torch.arange(40), cache)
        cache.commit()
        steps = []
        for i in range(40, 50):
            steps.append(ours(ids[i:i + 1], torch.tensor([i]), cache)[0])
            cache.commit()
    assert rel_err(a, ref[:40]) < TOL
    assert rel_err(torch.cat(steps), ref[40:]) < TOL


def test_unsupported_architecture_is_refused() -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_hf(cfg)


@pytest.mark.slow
def test_real_smollm2_matches_transformers(smol_fp32) -> None:
    from core.runtime.loading import resolve

    folder, _ = resolve("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens, builder = sample_tree(60, 49152)
    model = smol_fp32.model
    assert model.native and model.layers[0].wqkv.packed.fmt == "f32"
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
        cache = model.new_cache(128)
        lp, _ = model(torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1), cache)
        cache.commit()
        ls, _ = model(torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1]), cache)
        cache.commit()
        assert rel_err(lp, ref[:-1]) < TOL
        assert rel_err(ls[0], ref[-1]) < TOL
        tree = builder.build(10)
        lt, _ = model(torch.tensor(tree.tokens[1:]), tree.positions(len(tokens) - 1)[1:], cache, tree.mask()[1:, 1:])
        for i in range(len(tree) - 1):
            expect = hf(torch.tensor([tokens + path_tokens(tree, i + 1)])).logits[0, -1]
            assert rel_err(lt[i], expect) < TOL
