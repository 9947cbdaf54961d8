"""Training the drafting heads by self-distillation, reproducibly, on a CPU.

`python -m core train-heads --model smollm2-135m --out assets/heads/smollm2-135m.safetensors` runs six resumable
stages, caching their products outside git (`--data-dir`, default under TOKENSWIFT_CACHE):
1. data: the base model continues every writing prompt in assets/prompts/train_prompts.jsonl (chat template, the
   studio sampling settings, end-of-sequence suppressed), batched, `--samples-per-prompt` times each; one JSON line
   per sample. Run again with more samples per prompt, it adds only the new ones; `--max-samples` stops early (the
   shortest prompts' samples come first).
2. hidden: the frozen model's pre-final-norm hidden states at every output position (what the heads read), again
   whenever the samples have changed.
3. train: the heads alone, loss = sum of the cross-entropies for tokens t+2, t+3, t+4 (AdamW, warmup + cosine, as in
   the paper), over the heads' vocabulary (the ids the model writes most); checkpointed, resumable, time-budgeted.
4. root: the root head (tokenswift/heads.py) on the same rows, predicting t+2 from the hidden state and the token t+1,
   distilled from the model's own distribution for t+2 (read from the next row's hidden state, at the studio
   temperature): a whole distribution per row teaches more than the one token sampled from it, and what decides a
   draft's acceptance is how well it matches that distribution under the sampler's noise. Same optimiser and
   checkpointing; saved into the heads' file.
5. chain (with `--root-chain N` > 1): the root head learns to draft N levels by reading its own state back with the
   token above (tokenswift/heads.py), distilled at each level from the model's distribution there (chain_losses). An
   EAGLE-style pull of its state towards the model's hidden state (`--chain-feature-weight`) cost level 1 more than
   it gave below (held out, 400 steps: 0.1 gave 0.53 accepted tokens per chain against 0.55 without).
6. eval: per-head top-1/top-3 accuracy on held-out prompts' text, and the root head's drawn rate: how often its
   draft, drafted as in generation, is the very token the studio sampler draws there with the same noise; a JSON
   card is written beside the heads.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from core.generation.sampling import PRESETS, Sampler, SamplingSettings, gumbel_noise, nucleus
from core.generation.text import encode_prompt
from core.runtime.loading import load_model, load_tokenizer, resolve
from core.runtime.paths import ASSETS, cache_root
from core.tokenswift.heads import DraftHeads, load_heads, save_heads

STAGES = ("data", "hidden", "train", "root", "chain", "eval")


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default=None, help="heads file (default assets/heads/<model>.safetensors)")
    p.add_argument("--prompts", default=str(ASSETS / "prompts/train_prompts.jsonl"))
    p.add_argument("--data-dir", default=None, help="cache of generated data and checkpoints (outside git)")
    p.add_argument("--stage", default="all", choices=["all", *STAGES])
    p.add_argument("--gen-tokens", type=int, default=1024, help="tokens generated per prompt")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--max-samples", type=int, default=None,
                   help="generate at most this many samples in all (the shortest prompts first)")
    p.add_argument("--holdout", type=float, default=0.1, help="share of prompts held out for evaluation")
    p.add_argument("--head-vocab", type=int, default=8192, help="ids the heads score (0 = whole vocabulary)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--root-width", type=int, default=1152, help="hidden width of the root head (0 = none)")
    p.add_argument("--root-steps", type=int, default=1500)
    p.add_argument("--root-vocab", type=int, default=2048, help="ids the root head keeps after training (0 = all)")
    p.add_argument("--distill-temperature", type=float, default=0.7,
                   help="the root head learns the model's distribution at this temperature (0 = the sampled token)")
    p.add_argument("--root-chain", type=int, default=1,
                   help="levels the root head drafts, reading its own state back (1: the first level only)")
    p.add_argument("--chain-steps", type=int, default=600, help="steps teaching the root head to chain")
    p.add_argument("--chain-lr", type=float, default=1e-3)
    p.add_argument("--chain-feature-weight", type=float, default=0.0,
                   help="weight of the state's distance to the model's hidden state in the chain loss")
    p.add_argument("--max-minutes", type=float, default=None, help="stop (checkpointed) after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def data_dir_for(args: argparse.Namespace) -> Path:
    if args.data_dir:
        return Path(args.data_dir)
    return cache_root() / "train-data" / args.model.replace("/", "--")


def read_prompts(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def split_ids(prompts: list[dict[str, Any]], holdout: float, seed: int) -> set[str]:
    """Ids of the held-out prompts (a fixed random subset)."""
    ids = sorted(p["id"] for p in prompts)
    random.Random(seed).shuffle(ids)
    return set(ids[: max(1, int(len(ids) * holdout))])


# --- stage 1: self-distilled text -----------------------------------------------------------------------------------

def stage_data(args: argparse.Namespace, data: Path) -> None:
    from transformers import AutoModelForCausalLM  # slow to import; only the data stage needs it

    out = data / "samples.jsonl"
    done = {json.loads(line)["key"] for line in out.read_text().splitlines()} if out.exists() else set()
    folder, _ = resolve(args.model)
    tokenizer = load_tokenizer(folder)
    todo = [(f"{p['id']}#{k}", p["id"], encode_prompt(tokenizer, p["prompt"]), k)
            for p in read_prompts(args.prompts) for k in range(args.samples_per_prompt)]
    todo = [t for t in todo if t[0] not in done]
    if not todo:
        return
    todo.sort(key=lambda t: (t[3], len(t[2])))  # sample by sample; similar lengths per batch: little padding
    if args.max_samples is not None:
        todo = todo[:max(0, args.max_samples - len(done))]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    s = PRESETS["studio"]
    warp = StudioWarper(s.temperature, s.top_p)
    special = sorted(set(tokenizer.all_special_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else special[0]
    bar = tqdm(total=len(todo), desc="generating", unit="sample")
    with out.open("a") as f:
        for i in range(0, len(todo), args.gen_batch):
            batch = todo[i:i + args.gen_batch]
            width = max(len(t[2]) for t in batch)
            ids = torch.tensor([[pad] * (width - len(t[2])) + t[2] for t in batch])
            mask = torch.tensor([[0] * (width - len(t[2])) + [1] * len(t[2]) for t in batch])
            # seeded by the batch's place and its sample number: a second sample of a prompt is not the first again
            torch.manual_seed(args.seed * 100_003 + 1_000_003 * batch[0][3] + i)
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.gen_tokens,
                                     do_sample=True, top_p=1.0, top_k=0, repetition_penalty=s.penalty,
                                     suppress_tokens=special, pad_token_id=pad, logits_processor=[warp],
                                     # preallocated: the default cache concatenates every layer's keys and values
                                     # at each step, which halved this CPU's batched throughput at 1024 tokens
                                     cache_implementation="static")
            for (key, pid, prompt_ids, _), row in zip(batch, gen[:, width:].tolist()):
                f.write(json.dumps({"key": key, "prompt_id": pid, "prompt": prompt_ids, "output": row}) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()


class StudioWarper:
    """Temperature then top-p for HF's generate, with our nucleus: its own top-p sorts the whole vocabulary for
    every row of every step, which dominates a batched CPU generation."""

    def __init__(self, temperature: float, top_p: float):
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores / self.temperature
        return scores.masked_fill(~nucleus(scores, self.top_p), float("-inf"))


def read_samples(data: Path) -> list[dict[str, Any]]:
    path = data / "samples.jsonl"
    if not path.exists():
        raise RuntimeError(f"no generated data in {data}: run the data stage first")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- stage 2: hidden states -----------------------------------------------------------------------------------------

N_HEADS = 3
HIDDEN_FORMAT = 2  # 2: y holds tokens t+1..t+4 (1 held t+2..t+4)


def stage_hidden(args: argparse.Namespace, data: Path) -> None:
    target = data / "hidden.pt"
    samples = read_samples(data)
    if target.exists():
        done = torch.load(target, mmap=True)
        if done.get("format") == HIDDEN_FORMAT and done.get("samples") == len(samples):
            return  # else the data stage has added samples since: all are read again
    held = split_ids(read_prompts(args.prompts), args.holdout, args.seed)
    lm = load_model(args.model, device="cpu", native=False)
    model = lm.model
    parts: dict[str, dict[str, list[torch.Tensor]]] = {"train": {"h": [], "y": []}, "eval": {"h": [], "y": []}}
    for sample in tqdm(samples, desc="hidden states", unit="sample"):
        seq = sample["prompt"] + sample["output"]
        start = len(sample["prompt"]) - 1  # h at the last prompt token predicts the first output token
        cache = model.new_cache(len(seq))
        ids = torch.tensor(seq)
        hs = []
        with torch.inference_mode():
            for c in range(0, len(seq), 512):
                hs.append(model.hidden(ids[c:c + 512], torch.arange(c, min(c + 512, len(seq))), cache))
                cache.commit()
        h = torch.cat(hs)[start:]
        n = h.shape[0]
        # column k of y is token t+1+k for the hidden state at position t (column 0: the model's own next token, the
        # root the root head is conditioned on; head k predicts column k); -1 where the sequence has ended
        y = torch.full((n, N_HEADS + 1), -1, dtype=torch.long)
        for k in range(N_HEADS + 1):
            tgt = ids[start + 1 + k:]
            y[: len(tgt), k] = tgt[:n]
        split = "eval" if sample["prompt_id"] in held else "train"
        parts[split]["h"].append(h.half())
        parts[split]["y"].append(y)
    splits = {split: {"h": torch.cat(v["h"]), "y": torch.cat(v["y"])} for split, v in parts.items()}
    torch.save({"format": HIDDEN_FORMAT, "samples": len(samples), **splits}, target)


# --- stage 3: training ----------------------------------------------------------------------------------------------

def head_vocab(y: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor | None:
    """The `size` most frequent target ids (sorted), or None for the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = Counter(y[y >= 0].tolist())
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)), dtype=torch.long)


def lr_at(step: int, args: argparse.Namespace, steps: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, steps - args.warmup)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def remap_for(vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """Token id -> index in the heads' vocabulary (-1 outside it), or None for the whole vocabulary."""
    if vocab is None or not vocab.numel():
        return None
    remap = torch.full((vocab_size,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    return remap


def to_vocab(y: torch.Tensor, remap: torch.Tensor | None) -> torch.Tensor:
    """Targets as indices into the heads' vocabulary; -1 (ignored) for ended sequences and ids outside it."""
    return y if remap is None else remap[y.clamp(min=0)].masked_fill(y < 0, -1)


def head_losses(heads: Any, model: Any, h: torch.Tensor, y: torch.Tensor, remap: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy per head over the heads' vocabulary (y: tokens t+1..t+4); ignored targets are skipped."""
    logits = heads.logits(h, model)  # [3, n, V']
    targets = to_vocab(y[:, 1:].T, remap)
    return torch.stack([F.cross_entropy(logits[k], targets[k], ignore_index=-1) for k in range(logits.shape[0])])


def root_loss(heads: Any, model: Any, h: torch.Tensor, y: torch.Tensor, remap: torch.Tensor | None,
              h_next: torch.Tensor | None = None, temperature: float = 0.0) -> torch.Tensor:
    """Loss of the root head predicting token t+2 from the hidden state at t and the token t+1 (y[:, 0]): the
    cross-entropy against the model's own distribution for t+2 at `temperature` (from h_next, the hidden state at
    t+1), or, with temperature 0, against the sampled token."""
    logits = heads.root_logits(h, y[:, 0].clamp(min=0), model)
    if temperature <= 0 or h_next is None:
        return F.cross_entropy(logits, to_vocab(y[:, 1].masked_fill(y[:, 0] < 0, -1), remap), ignore_index=-1)[None]
    valid = root_rows(y)
    if not valid.any():
        return logits.sum()[None] * 0.0
    return distilled_ce(logits[valid], model, h_next[valid], heads.root_ids, temperature)[None]


def distilled_ce(logits: torch.Tensor, model: Any, h_next: torch.Tensor, ids: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """Mean cross-entropy of a head's logits over `ids` against the model's own distribution at `temperature`,
    read from its hidden states `h_next` at the positions whose next token the head predicts."""
    with torch.no_grad():
        target = (model_logits(model, h_next, ids) / temperature).softmax(-1)
    return -(target * (logits / temperature).log_softmax(-1)).sum(-1).mean()


def root_rows(y: torch.Tensor, levels: int = 1) -> torch.Tensor:
    """Mask of the rows a root head chained over `levels` learns from: tokens t+1 (its first input) to t+1+levels
    (its last target) all exist, so the next `levels` rows are the same text's positions t+1, t+2, ..."""
    return (y[:, :levels + 1] >= 0).all(1)


def model_logits(model: Any, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The model's own logits from pre-final-norm hidden states, over `ids` (empty: the whole vocabulary)."""
    rows = model.lm_head.weight[ids] if ids.numel() else model.lm_head.weight
    return F.linear(model.norm(h), rows).float()


def optimise(module: torch.nn.Module, losses_of: Any, n_rows: int, ckpt_path: Path, steps: int,
             args: argparse.Namespace, desc: str) -> int:
    """Train `module` (AdamW, warmup + cosine, clipped) on random batches of row indices (`losses_of(idx)` gives the
    losses); checkpointed every 200 steps (with the loss history), resumable with the same batches, stopped early by
    --max-minutes. Returns the steps done."""

    module.requires_grad_(True).train()
    decay = [p for p in module.parameters() if p.ndim == 2]  # matrices decay; norms and biases do not
    no_decay = [p for p in module.parameters() if p.ndim != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    step, history = 0, []
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path)
        module.load_state_dict(ckpt["heads"])
        opt.load_state_dict(ckpt["opt"])
        step, history = ckpt["step"], ckpt["history"]
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(step):  # the same batches as an uninterrupted run
        torch.randint(n_rows, (args.batch_tokens,), generator=gen)
    deadline = time.monotonic() + args.max_minutes * 60 if args.max_minutes else None
    bar = tqdm(total=steps, initial=step, desc=desc, unit="step")

    def checkpoint() -> None:
        torch.save({"heads": module.state_dict(), "opt": opt.state_dict(), "step": step, "history": history},
                   ckpt_path)

    while step < steps:
        idx = torch.randint(n_rows, (args.batch_tokens,), generator=gen)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args, steps)
        losses = losses_of(idx)
        opt.zero_grad(set_to_none=True)
        losses.sum().backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        step += 1
        history.append([step] + [round(v, 4) for v in losses.tolist()])
        bar.update(1)
        bar.set_postfix_str(" ".join(f"{v:.3f}" for v in losses.tolist()))
        if step % 200 == 0:
            checkpoint()
        if deadline and time.monotonic() > deadline:
            print(f"\nstopping at step {step}: --max-minutes reached (checkpoint saved; run again to resume)")
            break
    bar.close()
    checkpoint()
    module.eval().requires_grad_(False)
    return step


def load_hidden(data: Path) -> dict[str, Any]:
    tensors = torch.load(data / "hidden.pt")
    if tensors.get("format") != HIDDEN_FORMAT:
        raise RuntimeError(f"{data / 'hidden.pt'} is from an older version: delete it and run the hidden stage again")
    return tensors


def stage_train(args: argparse.Namespace, data: Path) -> None:
    tensors = load_hidden(data)
    h_all, y_all = tensors["train"]["h"], tensors["train"]["y"]
    model = load_model(args.model, device="cpu", native=False).model
    vocab = head_vocab(y_all[:, 1:], args.head_vocab, model.cfg.vocab_size)
    remap = remap_for(vocab, model.cfg.vocab_size)
    heads = DraftHeads.initial(model, N_HEADS, vocab)
    step = optimise(heads, lambda idx: head_losses(heads, model, h_all[idx].float(), y_all[idx], remap), len(h_all),
                    data / "checkpoint.pt", args.steps, args, "training heads")
    n_train = int((y_all[:, 1] >= 0).sum())
    save_heads(heads, out_path(args), model, args.model, {"steps": step, "train_tokens": n_train})


def trained_so_far(args: argparse.Namespace, data: Path) -> tuple[dict[str, Any], Any, Path, Any]:
    """What a stage after the train stage starts from: the hidden states, the frozen model, the heads file and the
    heads in it."""

    tensors = load_hidden(data)
    model = load_model(args.model, device="cpu", native=False).model
    out = out_path(args)
    return tensors, model, out, load_heads(out, model, args.model)


def stage_root(args: argparse.Namespace, data: Path) -> None:
    """The root head, trained on the same rows beside the frozen heads of the train stage; saved into their file."""

    if not args.root_width:
        return
    tensors, model, out, heads = trained_so_far(args, data)
    h_all, y_all = tensors["train"]["h"], tensors["train"]["y"]
    heads.add_root_head(model, args.root_width)
    remap = remap_for(heads.vocab, model.cfg.vocab_size)
    last = len(h_all) - 1

    def losses_of(idx: torch.Tensor) -> torch.Tensor:
        h_next = h_all[(idx + 1).clamp(max=last)].float()
        return root_loss(heads, model, h_all[idx].float(), y_all[idx], remap, h_next, args.distill_temperature)

    step = optimise(heads.root, losses_of, len(h_all), data / "root_checkpoint.pt", args.root_steps, args,
                    "training root head")
    # trained over the heads' vocabulary, it then keeps only the rows of the ids written most (heads.RootHead)
    targets = y_all[:, 1]
    if heads.vocab.numel():
        targets = targets[torch.isin(targets, heads.vocab)]
    kept = head_vocab(targets, args.root_vocab, len(heads.vocab) or model.cfg.vocab_size)
    if kept is not None:
        heads.keep_root_ids(kept)
    n_train = int(root_rows(y_all).sum())
    save_heads(heads, out, model, args.model, {**heads.meta, "root_steps": step, "root_width": args.root_width,
                                               "root_vocab": len(heads.root_ids), "root_train_tokens": n_train})


def chain_losses(heads: Any, model: Any, h_all: torch.Tensor, y_all: torch.Tensor, idx: torch.Tensor, levels: int,
                 temperature: float, feature_weight: float) -> torch.Tensor:
    """Per-level loss of a chained root head for the rows `idx`. At level d it has read the hidden state at t and
    the true tokens t+1..t+1+d, with its own states between (a deeper draft matters only once the ones above it
    were drawn, and then they are the true tokens); it is distilled from the model's distribution for token t+2+d
    at `temperature` (read from the hidden state at t+1+d, row idx+1+d), and, weighted, pulled towards that hidden
    state (smooth L1), so that reading its own state back is like reading the model's (EAGLE's feature loss)."""
    last = len(h_all) - 1
    y = y_all[idx]
    state = h_all[idx].float()
    out = []
    for d in range(levels):
        valid = root_rows(y, d + 1)
        state, logits = heads.root_step(state, y[:, d].clamp(min=0), model)
        if not valid.any():
            out.append(logits.sum() * 0.0)
            continue
        target_h = h_all[(idx + 1 + d).clamp(max=last)].float()[valid]
        ce = distilled_ce(logits[valid], model, target_h, heads.root_ids, temperature)
        out.append(ce + feature_weight * F.smooth_l1_loss(state[valid], target_h))
    return torch.stack(out)


def stage_chain(args: argparse.Namespace, data: Path) -> None:
    """Teach the trained root head to draft `--root-chain` levels by reading its own state back (chain_losses),
    starting from the root stage's head; saved into the heads' file with its chain length."""

    if args.root_chain <= 1:
        return
    if args.distill_temperature <= 0:
        raise ValueError("the chain stage distils every level from the model: --distill-temperature must be > 0")
    tensors, model, out, heads = trained_so_far(args, data)
    h_all, y_all = tensors["train"]["h"], tensors["train"]["y"]
    if heads.root is None:
        raise RuntimeError(f"{out} has no root head to chain: run the root stage with --root-width first")
    if args.root_chain > y_all.shape[1]:  # each level's target is one of the tokens the hidden stage stores
        raise ValueError(f"--root-chain must be at most {y_all.shape[1]}: the hidden stage keeps the "
                         f"{y_all.shape[1]} tokens after each position")
    heads.root_chain = args.root_chain
    settings = argparse.Namespace(**{**vars(args), "lr": args.chain_lr})
    step = optimise(heads.root, lambda idx: chain_losses(heads, model, h_all, y_all, idx, args.root_chain,
                                                         args.distill_temperature, args.chain_feature_weight),
                    len(h_all), data / "chain_checkpoint.pt", args.chain_steps, settings, "chaining root head")
    heads.meta = {**heads.meta, "chain_steps": step, "chain_train_tokens": int(root_rows(y_all).sum())}
    save_heads(heads, out, model, args.model, heads.meta)
    write_card_section(out, "root_chain", chain_card(args, data, heads, model, tensors))


def chain_card(args: argparse.Namespace, data: Path, heads: Any, model: Any, tensors: dict[str, Any]) -> dict:
    """The card's record of the chain stage: its data, settings, loss and held-out drawn rates per level."""
    samples = read_samples(data)
    ckpt = torch.load(data / "chain_checkpoint.pt")
    h_eval, y_eval = tensors["eval"]["h"], tensors["eval"]["y"]
    per_prompt = 1 + max(int(s["key"].rsplit("#", 1)[1]) for s in samples)
    return {
        "levels": heads.root_chain,
        "architecture": "the root head applied again to its own state (before the output norm) and its top draft, "
                        "for each level after the first; fine-tuned from the root stage's head, all levels at once",
        "data": {"samples": len(samples), "generated_tokens": sum(len(s["output"]) for s in samples),
                 "train_positions": int(heads.meta.get("chain_train_tokens", 0)) or None,
                 "eval_positions": int(root_rows(y_eval, heads.root_chain).sum()),
                 # the samples the data stage writes first (shortest prompts first), then the hidden stage
                 "command": f"python -m core train-heads --model {args.model} --stage data --gen-tokens "
                            f"{args.gen_tokens} --samples-per-prompt {per_prompt} --max-samples {len(samples)}"},
        "steps": ckpt["step"], "lr": args.chain_lr, "feature_weight": args.chain_feature_weight,
        "final_loss_per_level": final_losses(ckpt["history"]),
        "held_out (studio sampler)": chain_drawn_rates(heads, model, h_eval, y_eval, PRESETS["studio"],
                                                       heads.root_chain),
        "command": f"python -m core train-heads --model {args.model} --stage chain --root-chain {heads.root_chain} "
                   f"--chain-steps {args.chain_steps} --chain-lr {args.chain_lr} --chain-feature-weight "
                   f"{args.chain_feature_weight} --distill-temperature {args.distill_temperature} --batch-tokens "
                   f"{args.batch_tokens}",
    }


def write_card_section(out: Path, key: str, section: dict) -> None:
    """Set one section of the JSON card beside a heads file (the rest as the eval stage wrote it)."""
    path = out.with_suffix(".json")
    card = json.loads(path.read_text()) if path.exists() else {}
    card[key] = section
    path.write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({key: section}, indent=1))


def out_path(args: argparse.Namespace) -> Path:
    return Path(args.out) if args.out else ASSETS / "heads" / f"{args.model.replace('/', '--')}.safetensors"


# --- stage 4: evaluation and the card -------------------------------------------------------------------------------

@torch.no_grad()
def head_accuracy(heads: Any, model: Any, h: torch.Tensor, y: torch.Tensor) -> list[dict[str, float]]:
    """Top-1 / top-3 accuracy per head against the full-vocabulary targets."""
    hits1 = torch.zeros(heads.n_heads)
    hits3 = torch.zeros(heads.n_heads)
    count = torch.zeros(heads.n_heads)
    for c in range(0, len(h), 2048):
        logits = heads.logits(h[c:c + 2048].float(), model)
        top = logits.topk(3, dim=-1).indices
        if heads.vocab.numel():
            top = heads.vocab[top]
        yy = y[c:c + 2048, 1:].T  # [3, n]: tokens t+2..t+4
        valid = yy >= 0
        hit = top == yy[..., None]
        hits1 += (hit[..., 0] & valid).sum(1)
        hits3 += (hit.any(-1) & valid).sum(1)
        count += valid.sum(1)
    return [{"top1": round(float(hits1[k] / count[k]), 4), "top3": round(float(hits3[k] / count[k]), 4)}
            for k in range(heads.n_heads)]


@torch.no_grad()
def root_accuracy(heads: Any, model: Any, h: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Top-1 / top-3 accuracy of the root head for token t+2, given the true token t+1."""
    hits1 = hits3 = count = 0
    for c in range(0, len(h), 2048):
        yy = y[c:c + 2048]
        valid = root_rows(yy)
        top = heads.root_logits(h[c:c + 2048].float(), yy[:, 0].clamp(min=0), model).topk(3, dim=-1).indices
        ids = heads.root_ids
        hit = (ids[top] if ids.numel() else top) == yy[:, 1:2]
        hits1 += int((hit[:, 0] & valid).sum())
        hits3 += int((hit.any(-1) & valid).sum())
        count += int(valid.sum())
    return {"top1": round(hits1 / count, 4), "top3": round(hits3 / count, 4)}


@torch.no_grad()
def root_drawn_rate(heads: Any, model: Any, h: torch.Tensor, y: torch.Tensor, settings: SamplingSettings,
                    seed: int = 0) -> float:
    """How often the root head's draft is the very token the sampler draws: the acceptance rate of its drafts
    (chain_drawn_rates' first level)."""
    return chain_drawn_rates(heads, model, h, y, settings, 1, seed)["drawn"][0]


@torch.no_grad()
def chain_drawn_rates(heads: Any, model: Any, h: torch.Tensor, y: torch.Tensor, settings: SamplingSettings,
                      levels: int, seed: int = 0) -> dict[str, Any]:
    """How often the (chained) root head's top draft at each level is the very token the sampler draws there, over
    rows where every level's token exists: `drawn` per level, `given_drawn_above` per level (the rate among rows
    whose levels above were all drawn: a deeper draft is verified only below drawn ones) and `accepted`, the mean
    tokens a one-path chain of `levels` drafts would get accepted per step.

    The draft is drafted as in generation (its logits through Sampler.draft_scores, ranked with the sampler's
    Gumbel noise: heads.candidates), teacher-forced on the text's tokens; the draw is the sampler's with `settings`
    from the model's logits for that token (penalty over the text's tokens before it, temperature, filters) with
    that noise. The draw for row i's level d is at row i + d's position, with the noise for that position."""
    sampler = Sampler(settings, model.cfg.vocab_size)
    rows = torch.nonzero(root_rows(y, levels)).squeeze(1)
    hits = []
    for c in range(0, len(rows), 1024):
        r = rows[c:c + 1024]
        state, level_hits = h[r].float(), []
        for d in range(levels):
            scores = sampler.scores(model.logits(h[r + 1 + d].float()),
                                    penalty_windows(y[:, 0], r + d, settings.penalty_window))
            noise = torch.stack([gumbel_noise(seed, int(i) + d, scores.shape[-1]) for i in r])
            drawn = (scores + noise).argmax(-1)
            state, logits = heads.root_step(state, y[r, d], model)
            ids = heads.root_ids
            draft, _ = heads.candidates(sampler.draft_scores(logits, ids), 1, noise[:, ids] if ids.numel() else noise,
                                        ids)
            level_hits.append(draft[:, 0] == drawn)
        hits.append(torch.stack(level_hits))
    hit = torch.cat(hits, dim=1).float()  # [levels, rows]
    above = torch.cat([torch.ones_like(hit[:1]), hit.cumprod(0)[:-1]])  # every level above drawn
    return {"drawn": [round(float(x.mean()), 4) for x in hit],
            "given_drawn_above": [round(float((x * a).sum() / a.sum().clamp(min=1)), 4) for x, a in zip(hit, above)],
            "accepted": round(float(hit.cumprod(0).sum(0).mean()), 4)}


def penalty_windows(y0: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """[len(rows), width] penalty windows for drawing token t+2 at each row: the text's tokens up to t+1, from
    y0 = column 0 of y (a text's rows are contiguous and its last row has y0 = -1). Rows nearer a text's start
    than `width` repeat their own token t+1 (harmless: the penalty counts an id once)."""
    back = rows[:, None] - torch.arange(width)  # rows i, i-1, ...: each holds its token t+1
    ids = y0[back.clamp(min=0)]
    outside = ((back < 0) | (ids < 0)).cummax(dim=1).values  # walked back out of the text
    return torch.where(outside, ids[:, :1], ids)


def stage_eval(args: argparse.Namespace, data: Path) -> None:
    tensors = load_hidden(data)
    lm = load_model(args.model, device="cpu", native=False)
    out = out_path(args)
    heads = load_heads(out, lm.model, args.model)
    h_eval, y_eval = tensors["eval"]["h"], tensors["eval"]["y"]
    acc = head_accuracy(heads, lm.model, h_eval, y_eval)
    ckpt = torch.load(data / "checkpoint.pt")
    final = final_losses(ckpt["history"])
    samples = read_samples(data)
    y_train = tensors["train"]["y"]
    coverage = None
    if heads.vocab.numel():
        in_vocab = torch.isin(y_train[:, 1][y_train[:, 1] >= 0], heads.vocab)
        coverage = round(float(in_vocab.float().mean()), 4)
    card = {
        "base_model": args.model,
        "file": out.name,
        "architecture": "3 chained residual heads: h_k = h_{k-1} + W_k RMSNorm_k(h_{k-1}); logits_k = "
                        "lm_head(post-norm_k(h_k)), shared frozen lm_head restricted to the heads' vocabulary",
        "data": {
            "source": "self-distillation: the base model's own continuations of assets/prompts/train_prompts.jsonl "
                      "(chat template, studio sampling T=0.7 top-p=0.9 θ=1.1, special tokens suppressed)",
            "prompts": len({s["prompt_id"] for s in samples}),
            "samples": len(samples),
            "generated_tokens": sum(len(s["output"]) for s in samples),
            # what each stage trained on (the file's record: a later data stage may have added samples since)
            "train_positions": int(heads.meta.get("train_tokens", (y_train[:, 1] >= 0).sum())),
            "eval_positions": int((y_eval[:, 1] >= 0).sum()),
            "held_out_prompts": args.holdout,
        },
        "head_vocab": {"size": int(heads.vocab.numel()) or lm.config.vocab_size, "train_target_coverage": coverage},
        "training": {"steps": ckpt["step"], "batch_tokens": args.batch_tokens, "lr": args.lr,
                     "weight_decay": args.weight_decay, "warmup": args.warmup, "schedule": "linear warmup + cosine",
                     "optimizer": "AdamW(0.9, 0.95)", "final_loss_per_head": final, "seed": args.seed},
        "held_out_accuracy": {f"head{k + 1} (t+{k + 2})": a for k, a in enumerate(acc)},
        "command": "python -m core train-heads --model {m} --gen-tokens {g} --samples-per-prompt {spp} --steps {s} "
                   "--batch-tokens {b} --lr {lr} --head-vocab {v} --root-width {w} --root-steps {rs} "
                   "--root-vocab {rv} --distill-temperature {dt}".format(
                       m=args.model, g=args.gen_tokens, spp=args.samples_per_prompt, s=args.steps,
                       b=args.batch_tokens, lr=args.lr, v=args.head_vocab, w=args.root_width, rs=args.root_steps,
                       rv=args.root_vocab, dt=args.distill_temperature),
    }
    if heads.root is not None:
        root_ckpt = torch.load(data / "root_checkpoint.pt")
        card["architecture"] += ("; root head: state = h + W_down SiLU(W_up [RMSNorm(h); RMSNorm(embed(root))]), "
                                 "logits = lm_head(post-norm(state)), predicts t+2 knowing the token t+1")
        card["root_head"] = {"width": args.root_width, "steps": root_ckpt["step"], "vocab": len(heads.root_ids),
                             "train_positions": int(heads.meta.get("root_train_tokens", 0)) or None,
                             "distill_temperature": args.distill_temperature,
                             "final_loss": final_losses(root_ckpt["history"])[0],
                             "held_out_accuracy (t+2)": root_accuracy(heads, lm.model, h_eval, y_eval),
                             "held_out_drawn_rate (studio sampler)": root_drawn_rate(heads, lm.model, h_eval,
                                                                                     y_eval, PRESETS["studio"])}
    if heads.root is not None and heads.root_chain > 1:
        card["root_chain"] = chain_card(args, data, heads, lm.model, tensors)
    card_path = out.with_suffix(".json")
    if card_path.exists():  # a note written by hand about the data survives a re-evaluation
        note = json.loads(card_path.read_text()).get("data", {}).get("note")
        if note:
            card["data"]["note"] = note
    card_path.write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({**card["held_out_accuracy"], **card.get("root_head", {})}, indent=1))


def final_losses(history: list[list[float]]) -> list[float]:
    """Mean of the last 50 steps' losses, per loss."""
    tail = history[-50:]
    return [round(sum(r[k] for r in tail) / len(tail), 4) for k in range(1, len(tail[0]))]


def run_training(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    data = data_dir_for(args)
    data.mkdir(parents=True, exist_ok=True)
    stages = STAGES if args.stage == "all" else (args.stage,)
    for stage in stages:
        print(f"== {stage} ({data})", flush=True)
        {"data": stage_data, "hidden": stage_hidden, "train": stage_train, "root": stage_root,
         "chain": stage_chain, "eval": stage_eval}[stage](args, data)
    return 0
