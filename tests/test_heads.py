"""Drafting heads: the chained residual maths, save/load round trip, refusal of another model's heads."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from core.generation.sampling import Sampler, SamplingSettings
from core.runtime.model import ModelConfig, Transformer, build_model
from core.tokenswift.heads import DraftHeads, HeadsError, load_heads, save_heads


def tiny(seed: int, hidden: int = 64, tied: bool = False) -> Transformer:
    """A tiny Llama; `tied` shares its embedding table with the lm_head, as the default model does (on our kernels
    the root head then looks its tokens up in the packed table and runs natively)."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=tied)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return build_model(ModelConfig.from_hf(hf.config), hf.state_dict())


def test_initial_heads_predict_what_the_model_predicts() -> None:
    model = tiny(0)
    heads = DraftHeads.initial(model)
    h = torch.randn(5, 64)
    logits = heads.logits(h, model)
    assert logits.shape == (3, 5, 128)
    for k in range(3):
        assert torch.allclose(logits[k], model.logits(h), atol=1e-5)


def test_chained_residual_maths() -> None:
    model = tiny(0)
    heads = DraftHeads.initial(model)
    torch.nn.init.normal_(heads.proj[0].weight, std=0.1)
    torch.nn.init.normal_(heads.proj[1].weight, std=0.1)
    h0 = torch.randn(2, 64)
    h1 = h0 + heads.proj[0](heads.norm_in[0](h0))
    h2 = h1 + heads.proj[1](heads.norm_in[1](h1))
    states = heads.states(h0)
    assert torch.allclose(states[0], heads.norm_out[0](h1))
    assert torch.allclose(states[1], heads.norm_out[1](h2))


def test_vocabulary_subset_maps_back_to_token_ids() -> None:
    model = tiny(0)
    vocab = torch.tensor([3, 17, 40, 99])
    heads = DraftHeads.initial(model, vocab=vocab)
    ids, probs = heads.candidates(heads.logits(torch.randn(1, 64), model)[:, 0], 2)
    assert ids.shape == (3, 2) and set(ids.flatten().tolist()) <= set(vocab.tolist())
    assert torch.all(probs[:, 0] >= probs[:, 1])


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = tiny(0)
    heads = DraftHeads.initial(model, vocab=torch.tensor([1, 2, 3]))
    torch.nn.init.normal_(heads.proj[2].weight)
    path = tmp_path / "h.safetensors"
    save_heads(heads, path, model, "tiny-a")
    loaded = load_heads(path, model, "tiny-a")
    h = torch.randn(3, 64)
    assert torch.equal(loaded.logits(h, model), heads.logits(h, model))
    assert loaded.meta["base_model"] == "tiny-a"


def test_heads_of_another_model_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "h.safetensors"
    save_heads(DraftHeads.initial(tiny(0)), path, tiny(0), "tiny-a")
    with pytest.raises(HeadsError, match="trained for 'tiny-a'"):
        load_heads(path, tiny(1), "tiny-b")  # same shapes, other weights


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    model = tiny(0)
    with pytest.raises(HeadsError, match="does not exist"):
        load_heads(tmp_path / "nope.safetensors", model)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(HeadsError, match="unreadable"):
        load_heads(bad, model)


def test_root_head_starts_as_the_models_own_prediction_and_round_trips(tmp_path: Path) -> None:
    model = tiny(0)
    heads = DraftHeads.initial(model, vocab=torch.arange(0, 128, 2), root_width=32)
    h, roots = torch.randn(4, 64), torch.tensor([5, 9, 9, 100])
    # zero residual: the model's own next-token logits over the heads' vocabulary, whatever the root
    assert torch.allclose(heads.root_logits(h, roots, model), model.logits(h)[:, ::2], atol=1e-5)
    torch.nn.init.normal_(heads.root.down.weight, std=0.5)
    out = heads.root_logits(h, roots, model)
    assert not torch.allclose(out[1], heads.root_logits(h[1:2], torch.tensor([6]), model)[0]), "must read the root"
    path = tmp_path / "h.safetensors"
    save_heads(heads, path, model, "tiny-a")
    loaded = load_heads(path, model, "tiny-a")
    assert loaded.root is not None and loaded.root.up.out_features == 32
    assert torch.equal(loaded.root_logits(h, roots, model), out)
    assert load_heads(path, model).logits(h, model).shape == (3, 4, 64)


def test_root_head_scores_only_its_own_ids(tmp_path: Path) -> None:
    model = tiny(0)
    ids = torch.tensor([4, 10, 64])
    heads = DraftHeads.initial(model, vocab=torch.arange(0, 128, 2), root_width=32)
    h, roots = torch.randn(2, 64), torch.tensor([1, 2])
    heads.root_logits(h, roots, model)  # caches the lm_head rows it reads: restricting must drop that cache
    heads.keep_root_ids(ids)
    assert torch.allclose(heads.root_logits(h, roots, model), model.logits(h)[:, ids], atol=1e-5)
    picked, _ = heads.candidates(heads.root_logits(h, roots, model), 2, ids=heads.root_ids)
    assert set(picked.flatten().tolist()) <= {4, 10, 64}
    path = tmp_path / "h.safetensors"
    save_heads(heads, path, model, "tiny-a")
    assert torch.equal(load_heads(path, model).root_ids, ids)


def test_candidates_are_ranked_as_the_sampler_draws() -> None:
    model = tiny(0)
    vocab = torch.tensor([3, 17, 40, 99])
    heads = DraftHeads.initial(model, vocab=vocab)
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    noise = torch.zeros(1, 4)
    noise[0, 2] = 5.0  # the sampler will add a large bonus to id 40 (column 2) at this position
    ids, p = heads.candidates(logits, 2)
    assert ids[0].tolist() == [3, 17]
    sampler = Sampler(SamplingSettings(temperature=0.5, top_p=1.0), 128)
    ids, p = heads.candidates(sampler.draft_scores(logits, vocab), 2, noise)
    # logits / T + noise: 40 -> 0 + 5 beats 3 -> 4 and 17 -> 2
    assert ids[0].tolist() == [40, 3] and p[0, 0] > p[0, 1] and float(p.sum()) <= 1 + 1e-6
    # with top-p 0.9 the sampler never draws 40 there (1.6% of the mass at T = 0.5), so it is not drafted
    sampler = Sampler(SamplingSettings(temperature=0.5, top_p=0.9), 128)
    ids, p = heads.candidates(sampler.draft_scores(logits, vocab), 2, noise)
    assert ids[0].tolist() == [3, 17] and float(p.sum()) == pytest.approx(1.0)
    # nor is a banned id (e.g. end-of-sequence while writing to full length)
    sampler = Sampler(SamplingSettings(temperature=0.5, top_p=1.0), 128, banned=(40,))
    ids, _ = heads.candidates(sampler.draft_scores(logits, vocab), 2, noise)
    assert ids[0].tolist() == [3, 17]


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_the_kernels_root_step_computes_the_root_heads_modules(fmt: str) -> None:
    """On a native model the root head's step is one kernel call (kernels/root_head.h: RootHead.step): its state and
    logits are the PyTorch modules' (norms, up, SiLU, down, residual, output norm, the scored rows) on the same packed
    weights, up to float rounding, and it drafts the same tokens."""
    model = tiny(3)
    heads = DraftHeads.initial(model, vocab=torch.arange(0, 128, 2), root_width=32)
    for p in heads.root.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.2)
    assert model.to_native(fmt)
    heads.to_native(fmt)
    root, rows = heads.root, heads.scorer(model, "root_lm")
    h, roots = torch.randn(3, 64), torch.tensor([5, 77, 120])
    state, logits = heads.root_step(h, roots, model)
    want_state = root(h, model.embed(roots))
    want_logits = rows(root.norm_out(want_state))
    assert logits.shape == (3, 64)
    assert torch.allclose(state, want_state, rtol=1e-4, atol=1e-5)
    assert torch.allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(logits.topk(3).indices, want_logits.topk(3).indices)
    assert not torch.equal(state, h)  # the head moved the state: its matrices took part


def native_root_head() -> tuple[Transformer, DraftHeads]:
    """A tied tiny model on the kernels (q8_0) and heads with a random root head (q4_1) scoring its even ids: the
    root head's drafted level runs natively there."""
    model = tiny(4, tied=True)
    heads = DraftHeads.initial(model, vocab=torch.arange(0, 128, 2), root_width=32)
    for p in heads.root.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.2)
    assert model.to_native("q8_0")
    heads.to_native("q8_0", "q4_1")
    return model, heads


@pytest.mark.parametrize("settings", [SamplingSettings(), SamplingSettings(temperature=0.0),
                                      SamplingSettings(temperature=1.0, top_p=1.0, min_p=0.1, top_k=9)])
def test_a_root_heads_drafted_level_is_its_step_then_the_samplers_ranking(settings: SamplingSettings) -> None:
    """root_draft does in one kernel call what root_step then Sampler.rank_drafts do: the same state, the same
    drafts in the same order, the same chances; a banned id is never drafted."""
    model, heads = native_root_head()
    h = torch.randn(1, 64)
    state, logits = heads.root_step(h, torch.tensor([9]), model)
    banned = int(logits[0].argmax()) * 2  # the root head's top token: its column j scores token 2j
    sampler = Sampler(settings, 128, banned=(banned,))
    assert type(heads.root_drafter(model, sampler, 6)).__name__ == "RootDrafter", "the native drafter is not in use"
    for position in (5, 6, 700):
        want_ids, want_p = sampler.rank_drafts(logits, 6, position, heads.root_ids)
        got_state, ids, p = heads.root_draft(h, 9, model, sampler, 6, position)
        assert torch.equal(got_state, state)
        assert ids == want_ids.tolist()[0] and p == want_p.tolist()[0]
        assert banned not in ids and len(set(ids)) == 6


def test_a_chain_of_drafted_levels_reads_its_rows_and_states_where_they_lie() -> None:
    """The native drafted level reads the row it is given of a forward's states, and a chain reads each level's
    state (one of the drafter's two buffers, in turn) into the next: the same states and drafts as root_step on
    rows cut out, level after level."""
    model, heads = native_root_head()
    sampler = Sampler(SamplingSettings(), 128)
    draft = heads.root_drafter(model, sampler, 3)
    assert type(draft).__name__ == "RootDrafter", "the native drafter is not in use"
    states = torch.randn(5, 64)
    for row in (0, 3, 4):
        state, row_read, token = states, row, 11
        want = states[row:row + 1]
        for level in range(4):
            want, logits = heads.root_step(want, torch.tensor([token]), model)
            want_ids, want_p = sampler.rank_drafts(logits, 3, 40 + level, heads.root_ids)
            state, ids, p = draft(state, row_read, token, 40 + level)
            assert torch.equal(state, want) and ids == want_ids.tolist()[0] and p == want_p.tolist()[0]
            row_read, token = 0, ids[0]
    with pytest.raises(RuntimeError, match="row"):
        draft(states, 5, 11, 40)
