"""The head-training pipeline end to end on a tiny random model: every stage, the root head restricted to its ids,
the card, and resuming where a run stopped."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from core.runtime.loading import load_model
from core.tokenswift.heads import load_heads
from core.tools.cli import main
from core.tools.train_heads import penalty_windows, read_samples
from tests.conftest import make_tiny_checkpoint


def tiny_pipeline(tmp_path: Path, steps: int) -> tuple[Path, Path, Path, list[str]]:
    """A tiny random model, ten prompts, and train-heads arguments for them: (model folder, heads file, data dir,
    arguments)."""
    folder = make_tiny_checkpoint(tmp_path / "m", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Write story {i}."}) + "\n" for i in range(10)))
    out, data = tmp_path / "h.safetensors", tmp_path / "data"
    args = ["train-heads", "--model", str(folder), "--prompts", str(prompts), "--data-dir", str(data), "--out", str(out),
            "--gen-tokens", "24", "--steps", str(steps), "--batch-tokens", "64", "--warmup", "5", "--head-vocab", "64",
            "--root-width", "32", "--root-vocab", "16"]
    return folder, out, data, args


def test_pipeline_trains_heads_and_root_head_and_resumes(tmp_path: Path) -> None:
    folder, out, data, args = tiny_pipeline(tmp_path, steps=20)
    assert main([*args, "--root-steps", "20"]) == 0
    hidden = torch.load(data / "hidden.pt")
    y = hidden["train"]["y"]
    assert y.shape[1] == 4 and bool((y[:-1, 1] == y[1:, 0])[y[1:, 0] >= 0].float().mean() > 0.9)  # t+2 is next's t+1
    heads = load_heads(out, load_model(str(folder)).model)
    assert heads.vocab.numel() == 64 and heads.root is not None and heads.root.up.out_features == 32
    assert len(heads.root_ids) == 16 and bool(torch.isin(heads.root_ids, heads.vocab).all())
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["root_head"]["steps"] == 20 and card["root_head"]["vocab"] == 16 and "--root-vocab 16" in card["command"]
    # distilled from the model's distribution by default, and the rate at which its drafts are drawn is measured
    assert card["root_head"]["distill_temperature"] == 0.7 and "--distill-temperature 0.7" in card["command"]
    assert 0.0 <= card["root_head"]["held_out_drawn_rate (studio sampler)"] < 1.0
    # a longer root run resumes from the checkpoint instead of starting over
    assert main([*args, "--root-steps", "30", "--stage", "root"]) == 0
    assert torch.load(data / "root_checkpoint.pt")["step"] == 30
    assert load_heads(out, load_model(str(folder)).model).meta["root_steps"] == "30"
    # a second sample per prompt is new text (seeded by its sample number), and the card says what each stage used
    samples = read_samples(data)
    assert main([*args, "--root-steps", "30", "--stage", "data", "--samples-per-prompt", "2"]) == 0
    second = {s["prompt_id"]: s["output"] for s in read_samples(data) if s["key"].endswith("#1")}
    assert len(second) == 10 and all(second[s["prompt_id"]] != s["output"] for s in samples)
    assert main([*args, "--stage", "hidden"]) == 0  # the hidden states follow the samples added
    assert torch.load(data / "hidden.pt")["samples"] == 20
    assert card["data"]["train_positions"] == int(load_heads(out, load_model(str(folder)).model).meta["train_tokens"])
    assert card["root_head"]["train_positions"] > 0


def test_penalty_windows_stay_inside_each_text() -> None:
    y0 = torch.tensor([5, 6, 7, -1, 8, 9, -1])  # two texts' tokens t+1, each ending in a row without one
    windows = penalty_windows(y0, torch.tensor([0, 2, 4, 5]), 3)
    # newest first; a row nearer its text's start than the width repeats its own token (the penalty counts ids once)
    assert windows.tolist() == [[5, 5, 5], [7, 6, 5], [8, 8, 8], [9, 8, 9]]


def test_chain_stage_teaches_the_root_head_to_draft_deeper(tmp_path: Path) -> None:
    folder, out, data, args = tiny_pipeline(tmp_path, steps=10)
    args += ["--root-steps", "10", "--max-samples", "8", "--gen-batch", "4", "--root-chain", "3", "--chain-steps", "40",
             "--chain-lr", "0.01"]
    assert main(args) == 0
    assert len(read_samples(data)) == 8  # --max-samples: the shortest prompts' samples only
    model = load_model(str(folder)).model
    heads = load_heads(out, model)
    assert heads.root_chain == 3 and heads.meta["chain_steps"] == "40"
    history = torch.load(data / "chain_checkpoint.pt")["history"]
    first, last = (torch.tensor([row[1:] for row in rows]).mean(0) for rows in (history[:5], history[-5:]))
    assert bool((last < first).all()), f"every level's loss should fall: {first} -> {last}"
    card = json.loads(out.with_suffix(".json").read_text())
    chain = card["root_chain"]
    assert chain["levels"] == 3 and chain["steps"] == 40 and "--root-chain 3" in chain["command"]
    held = chain["held_out (studio sampler)"]
    assert len(held["drawn"]) == 3 and len(held["given_drawn_above"]) == 3 and 0.0 <= held["accepted"] <= 3.0
    # every level is distilled from the model: a temperature of 0 (train on the sampled token) is refused, not NaN
    assert main([*args, "--stage", "chain", "--distill-temperature", "0"]) == 2
    assert main([*args, "--stage", "chain", "--root-chain", "5"]) == 2  # deeper than the stored tokens: refused
    # a step gives the state the next level reads back, and the logits root_logits gives
    h, roots = torch.randn(2, model.cfg.hidden_size), torch.tensor([3, 4])
    state, logits = heads.root_step(h, roots, model)
    assert state.shape == h.shape and logits.shape == (2, len(heads.root_ids))
    assert torch.equal(logits, heads.root_logits(h, roots, model))
