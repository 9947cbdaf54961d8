"""Logits processing matches Hugging Face's processors; draws are position-keyed and follow the processed
distribution (chi-square)."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from core.generation.decoding import GenerationConfig
from core.generation.sampling import (
    PRESETS,
    Sampler,
    SamplingSettings,
    apply_penalty,
    filter_logits,
    _mix,
    gumbel_noise,
    rank_drafts,
)
from core.runtime.kernels.cpu import kernel

# chi-square critical values at p = 0.001 for the degrees of freedom used below
CHI2_CRIT = {7: 24.32, 5: 20.52, 3: 16.27}


def test_penalty_matches_hf_repetition_penalty() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    window = torch.randint(50, (3, 20))  # repeated ids inside a window: penalised once
    ours = apply_penalty(logits.clone(), window, 1.3)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(window, logits.clone())
    assert torch.equal(ours, ref)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[window[0]] = False
    assert torch.equal(ours[0, untouched], logits[0, untouched])


@pytest.mark.parametrize("s", [
    SamplingSettings(temperature=0.7, top_p=0.9),
    SamplingSettings(temperature=1.0, top_p=1.0, min_p=0.1),
    SamplingSettings(temperature=1.3, top_k=5, top_p=0.8, min_p=0.05),
])
def test_filters_match_hf_warpers(s: SamplingSettings) -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 100) * 2
    ref = logits.clone()
    ids = torch.zeros(4, 1, dtype=torch.long)
    for warper, on in [(TemperatureLogitsWarper(s.temperature), True), (TopKLogitsWarper(max(s.top_k, 1)), s.top_k > 0),
                       (TopPLogitsWarper(s.top_p), s.top_p < 1), (MinPLogitsWarper(s.min_p or 0.5), s.min_p > 0)]:
        if on:
            ref = warper(ids, ref)
    assert torch.equal(filter_logits(logits.clone(), s), ref)


def test_noise_is_a_function_of_seed_position_and_token() -> None:
    assert torch.equal(gumbel_noise(5, 100, 64), gumbel_noise(5, 100, 64))
    assert not torch.equal(gumbel_noise(5, 100, 64), gumbel_noise(5, 101, 64))
    assert not torch.equal(gumbel_noise(5, 100, 64), gumbel_noise(6, 100, 64))
    ids = torch.tensor([63, 2, 40])  # any subset of tokens gets the noise they have in the whole vocabulary
    assert torch.equal(gumbel_noise(5, 100, ids), gumbel_noise(5, 100, 64)[ids])
    g = gumbel_noise(7, 3, 200_000).double()  # standard Gumbel: mean ~0.5772, variance pi^2 / 6
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - 1.6449) < 0.03


def test_the_kernels_key_and_window_each_draw_as_the_sampler_does() -> None:
    """The bound draw (kernels/draw.h: Draw) derives a position's noise key as the sampler does, and a draw after
    the sequence so far takes the sequence's last ids as its window, as a draw given that window does."""
    assert kernel() is not None, "the CPU kernels did not build"
    for seed in (0, 1, 12345, 2**63 - 1):
        native = Sampler(SamplingSettings(seed=seed), 64).native
        assert [native.key(p) for p in (0, 1, 7, 10**6, 2**40)] == [_mix(seed, p) for p in (0, 1, 7, 10**6, 2**40)]
    sampler = Sampler(SamplingSettings(temperature=1.0, top_p=1.0, penalty=3.0, penalty_window=4), 64)
    history = torch.randint(64, (20,), generator=torch.Generator().manual_seed(3))
    logits = torch.randn(64, generator=torch.Generator().manual_seed(4))
    drawn = set()
    for length in range(0, 21):
        window = history[max(0, length - 4):length]
        drawn.add(sampler.draw(logits, window, length))
        assert sampler.draw_after(logits, history, length) == sampler.draw(logits, window, length), length
    assert len(drawn) > 5  # the windows and keys differ, and so do the draws


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token the processed distribution excludes"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("settings,df", [
    (SamplingSettings(temperature=0.8, top_p=1.0, penalty=1.0), 7),
    (SamplingSettings(temperature=1.0, top_p=0.95, penalty=1.5, penalty_window=2), 5),
], ids=["temperature", "top-p+penalty"])
def test_draws_follow_the_processed_distribution(settings: SamplingSettings, df: int) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    window = torch.tensor([[0, 1]])
    sampler = Sampler(settings.with_(seed=123), vocab=8)
    scores = sampler.scores(logits, window)
    probs = scores.softmax(-1)[0]
    n = 20_000
    counts = torch.zeros(8)
    for position in range(n):
        counts[int(sampler.choose(scores, [position]))] += 1
    assert int((probs > 0).sum()) == df + 1
    assert chi_square(counts, probs) < CHI2_CRIT[df]


@pytest.mark.parametrize("settings,df", [
    (SamplingSettings(temperature=0.8, top_p=1.0, penalty=1.0), 7),
    (SamplingSettings(temperature=1.0, top_p=0.95, penalty=1.5, penalty_window=2), 5),
    (SamplingSettings(temperature=0.7, top_p=1.0, top_k=4, penalty=1.2, penalty_window=2), 3),
    (SamplingSettings(temperature=1.0, top_p=1.0, min_p=0.1, penalty=1.2, penalty_window=2), 5),
], ids=["temperature", "top-p+penalty", "top-k", "min-p"])
def test_the_native_draw_samples_the_processed_distribution(settings: SamplingSettings, df: int) -> None:
    """The kernel's draw (the one both decoders use on a CPU) follows the distribution Sampler.scores describes, and
    never draws a token the filters exclude; greedily it is the argmax."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    window = torch.tensor([0, 1, 1])
    sampler = Sampler(settings.with_(seed=321), vocab=8)
    assert kernel() is not None, "the CPU kernels did not build"
    probs = sampler.scores(logits[None], window[None]).softmax(-1)[0]
    counts = torch.zeros(8)
    for position in range(20_000):
        counts[sampler.draw(logits, window, position)] += 1
    assert int((probs > 0).sum()) == df + 1
    assert chi_square(counts, probs) < CHI2_CRIT[df]
    greedy = Sampler(settings.with_(temperature=0), vocab=8)
    penalised = greedy.scores(logits[None], window[None])[0]
    assert all(greedy.draw(logits, window, p) == int(penalised.argmax()) for p in range(20))


@pytest.mark.parametrize("settings", [
    PRESETS["studio"], PRESETS["paper"], PRESETS["greedy"], PRESETS["studio"].with_(temperature=3.0),
    PRESETS["studio"].with_(temperature=20.0, top_p=0.99), PRESETS["studio"].with_(min_p=0.02),
], ids=["studio", "paper", "greedy", "hot", "flat", "min-p"])
def test_the_native_draw_is_the_processed_distributions_on_real_logits(smol_engine, settings) -> None:
    """On the real model's logits (49K ids) the kernel's draw, whichever way it takes (its nucleus read as a list
    of ids, or the whole vocabulary filtered), draws exactly the token PyTorch's definition draws: the argmax of
    Sampler.scores plus the position's noise, at every position."""
    model = smol_engine.model
    ids = smol_engine.tokenizer.encode("The old lighthouse keeper climbed the stairs, and at the top he found")
    logits, _ = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))
    sampler = Sampler(settings, model.cfg.vocab_size)
    for position in range(300):
        row, window = logits[position % len(ids)], torch.tensor(ids[: position % len(ids) + 1])
        expected = int(sampler.choose(sampler.scores(row[None], window[None]), [position])[0])
        assert sampler.draw(row, window, position) == expected, position


@pytest.mark.parametrize("settings", [
    PRESETS["studio"], PRESETS["paper"], PRESETS["greedy"], PRESETS["studio"].with_(temperature=20.0, top_p=0.99),
], ids=["studio", "paper", "greedy", "flat"])
def test_the_native_draw_is_the_same_on_any_number_of_threads(smol_engine, settings) -> None:
    """The draw's passes over the vocabulary are shared by the threads (kernels/draw.h: for_blocks), each block's
    sums taken alone and added in block order: one thread and two draw the same token from every row, the real
    model's and rows whose top-p boundary lies among ties or far down the tail."""
    assert kernel() is not None, "the CPU kernels did not build"
    model = smol_engine.model
    ids = smol_engine.tokenizer.encode("The old lighthouse keeper climbed the stairs, and at the top he found")
    logits, _ = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))
    rows = torch.cat([logits, nucleus_rows(model.cfg.vocab_size)[0]])
    sampler = Sampler(settings, model.cfg.vocab_size)
    threads = torch.get_num_threads()
    drawn = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            drawn[n] = [sampler.draw(rows[p % len(rows)], torch.tensor(ids[: p % len(ids) + 1]), p) for p in range(200)]
    finally:
        torch.set_num_threads(threads)
    assert drawn[1] == drawn[2]
    assert len(set(drawn[2])) > (1 if settings.greedy else 20)  # (rows drawn from, not one token repeated)


@pytest.mark.parametrize("settings", [
    PRESETS["studio"], PRESETS["paper"], PRESETS["greedy"], PRESETS["studio"].with_(penalty_window=2),
], ids=["studio", "paper", "greedy", "window-2"])
def test_the_kernels_walk_accepts_what_drawing_node_by_node_accepts(smol_engine, settings) -> None:
    """Verification's walk in one kernel call (Sampler.walk) accepts the nodes, and draws the token after them, that
    drawing node by node does (Generation.walk without the kernels: `draw` with the sequence and the path so far as
    the window), on the real model's logits and trees that hold the drawn token at most nodes, so that walks run deep
    (past a penalty window of 2)."""
    assert kernel() is not None, "the CPU kernels did not build"
    model = smol_engine.model
    ids = smol_engine.tokenizer.encode("The old lighthouse keeper climbed the stairs, and at the top he found")
    logits, _ = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))
    rng = torch.Generator().manual_seed(7)
    config = GenerationConfig(max_new_tokens=64, method="tokenswift", sampling=settings)
    deepest = 0
    for trial in range(40):
        gen = smol_engine.generate(ids[: 2 + trial % (len(ids) - 2)], config)
        rows = logits[torch.randint(len(ids), (16,), generator=rng)]
        tokens, parents, depths, paths = [gen.tokens[-1]], [-1], [0], [[]]
        for node in range(16):  # breadth first: the token drawn at the node, mostly, and a stranger or two
            if node == len(tokens):
                break
            if depths[node] == 5:
                continue
            drawn = gen.draw(rows[node], paths[node])
            strangers = torch.randint(model.cfg.vocab_size, (2,), generator=rng).tolist()
            for child in ([drawn] if torch.rand(1, generator=rng) < 0.8 else []) + strangers:
                if len(tokens) < 16 and child not in [t for t, p in zip(tokens, parents) if p == node]:
                    tokens.append(child), parents.append(node), depths.append(depths[node] + 1)
                    paths.append(paths[node] + [child])
        native = gen.walk(rows[: len(tokens)], tokens, parents)
        gen.sampler.walk = lambda *args: None  # the draw-by-draw walk
        assert gen.walk(rows[: len(tokens)], tokens, parents) == native, trial
        deepest = max(deepest, len(native[0]))
    assert deepest >= 3


def test_greedy_is_argmax_of_penalised_logits() -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0]])
    s = SamplingSettings(temperature=0, penalty=1.1, penalty_window=4)
    sampler = Sampler(s, vocab=3)
    assert int(sampler.choose(sampler.scores(logits, torch.tensor([[2]])), [0])) == 0
    # token 0 was just written: 3.0 / 1.1 < 2.9
    assert int(sampler.choose(sampler.scores(logits, torch.tensor([[0]])), [0])) == 1


def test_banned_tokens_are_never_drawn() -> None:
    sampler = Sampler(SamplingSettings(temperature=1.0, top_p=1.0), vocab=4, banned=(0,))
    scores = sampler.scores(torch.tensor([[9.0, 0.0, 0.0, 0.0]]), torch.tensor([[1]]))
    assert all(int(sampler.choose(scores, [p])) != 0 for p in range(200))


@pytest.mark.parametrize("change,message", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top-p"), ({"top_k": -2}, "top-k"),
    ({"min_p": 1.0}, "min-p"), ({"penalty": 0.5}, "penalty"), ({"penalty_window": 0}, "window"),
    ({"seed": -1}, "seed"),
])
def test_out_of_range_settings_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PRESETS["studio"].with_(**change).validate()


@pytest.mark.parametrize("name", ["studio", "paper", "greedy"])
def test_draft_scores_process_a_drafter_as_scores_process_the_model(name: str) -> None:
    """Without a penalty, a drafter over the whole vocabulary is processed exactly as the model's logits are; over a
    subset of ids, as if those ids were the whole vocabulary (filters over the subset's own mass), banned ids out."""
    settings = PRESETS[name].with_(penalty=1.0)
    sampler = Sampler(settings, 300, banned=(7,))
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)) * 3
    window = torch.zeros(3, 1, dtype=torch.long)
    assert torch.equal(sampler.draft_scores(logits), sampler.scores(logits, window))
    ids = torch.tensor([2, 7, 50, 51])
    sub = sampler.draft_scores(logits[:, ids], ids)
    assert torch.equal(sub, Sampler(settings, 4, banned=(1,)).scores(logits[:, ids], window))
    assert bool(torch.isinf(sub[:, 1]).all())


@pytest.mark.parametrize("name", ["studio", "paper", "greedy"])
@pytest.mark.parametrize("subset", [True, False], ids=["ids", "vocabulary"])
def test_the_kernels_rank_drafts_as_pytorch_does(name: str, subset: bool) -> None:
    """Sampler.rank_drafts in one kernel call (the draw's own filters, then each survivor's Gumbel noise) proposes
    the same drafts, in the same order and with the same chances, as PyTorch's operators: draft_scores plus the
    noise, softmax, top-k. Banned ids are never proposed."""
    assert kernel() is not None, "the CPU kernels did not build"
    vocab = 5000
    sampler = Sampler(PRESETS[name].with_(seed=11), vocab, banned=(2, 7))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(vocab, generator=gen)[:2048] if subset else None
    ids = torch.cat([torch.tensor([2, 7]), ids[2:]]) if subset else None  # banned ids among the columns
    logits = torch.randn(4, 2048 if subset else vocab, generator=gen)
    logits[:, [0, 1] if subset else [2, 7]] += 20  # the banned tokens would be every row's top drafts
    got_ids, got_p = sampler.rank_drafts(logits, 5, 300, ids)
    noise = None if sampler.s.greedy else torch.stack([sampler.noise(300 + i, ids) for i in range(4)])
    want_ids, want_p = rank_drafts(sampler.draft_scores(logits, ids), 5, noise, ids)
    assert bool((want_p > 0).all())  # (tokens the filters cut have no order to compare)
    assert torch.equal(got_ids, want_ids)
    assert torch.allclose(got_p, want_p, rtol=1e-5, atol=1e-7)
    assert not bool(torch.isin(got_ids, torch.tensor([2, 7])).any())


def nucleus_rows(vocab: int) -> tuple[torch.Tensor, list[float]]:
    """Rows whose top-p sets the kernel finds by buckets of values, each with its top_p: 100 tied tokens with the
    boundary among them (ranked by id), a wide spread over many buckets (seeded), and a top token with 100 tied
    ones below e^-14 that the set must reach into half-way (the kernel's second pass, over every token)."""
    gen = torch.Generator().manual_seed(5)
    ties = torch.full((vocab,), -40.0)
    ties[torch.randperm(vocab, generator=gen)[:100]] = 0.0
    spread = torch.randn(vocab, generator=gen) * 3
    tail = torch.full((vocab,), -40.0)
    tail[torch.randperm(vocab, generator=gen)[:100]] = -14.0
    tail[123] = 0.0
    small, rest = math.exp(-14.0), (vocab - 101) * math.exp(-40.0)
    return torch.stack([ties, spread, tail]), [0.505, 0.9, (1 + 50.5 * small) / (1 + 100 * small + rest)]


def test_the_kernels_top_p_set_on_a_whole_vocabulary() -> None:
    """The draw's nucleus (found by buckets of values, then the boundary bucket ranked token by token) is the fewest
    tokens ranked by (probability desc, id asc) whose mass reaches top_p, computed here in double by a stable sort:
    on rows spanning many buckets, with the boundary among tied tokens, and reaching past the tokens with e >= 1e-6.
    Read through rank_drafts over the whole vocabulary: the survivors are exactly the tokens with a chance."""
    assert kernel() is not None, "the CPU kernels did not build"
    vocab = 49152
    rows, tops = nucleus_rows(vocab)
    for row, top_p in zip(rows, tops):
        probs, order = row.double().softmax(-1).sort(descending=True, stable=True)  # ties keep id order
        cum = probs.cumsum(-1)
        size = int((cum < top_p).sum()) + 1
        step = float(probs[size - 1])  # the boundary lies well inside a token's share: no rounding-close call
        assert min(cum[size - 1] - top_p, top_p - cum[size - 2]) > max(0.25 * step, 1e-7)
        want = torch.zeros(vocab, dtype=torch.bool)
        want[order[:size]] = True
        sampler = Sampler(SamplingSettings(temperature=1.0, top_p=top_p, penalty=1.0, seed=3), vocab)
        ids, p = sampler.rank_drafts(row[None], vocab, 40)
        got = torch.zeros(vocab, dtype=torch.bool)
        got[ids[0][p[0] > 0]] = True
        assert torch.equal(got, want), (top_p, int(got.sum()), size)
        assert 50 < size < vocab - 50
