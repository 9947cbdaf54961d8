"""The command-line flags the tools share (model, sampling, TokenSwift options) and what they build."""
from __future__ import annotations

import argparse
from dataclasses import replace

from core.engine import Engine
from core.generation.sampling import PRESETS, SamplingSettings
from core.runtime.loading import WEIGHTS
from core.tokenswift.options import TokenSwiftOptions


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: env TOKENSWIFT_MODEL or smollm2-135m)")
    p.add_argument("--heads", default="default",
                   help="drafting heads: 'default' (committed heads of a known model, or those inside a published "
                        "TokenSwift checkpoint), 'none', a heads file, or a TokenSwift checkpoint (folder or hub id) "
                        "whose backbone is the model")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--compile", action="store_true",
                   help="run the model through compiled fixed-size graphs (CUDA; a CPU runs its native kernels)")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="weight format: auto (the file's own: a GGUF's blocks on a CPU, bf16 on CUDA), fp32, bf16, "
                        "or q8 / q4 quantized on load (CPU)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="studio", choices=["studio", "paper", "greedy"],
                   help="sampling preset; the flags below override its values")
    p.add_argument("--temperature", type=float, help="0 means greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--penalty", type=float, help="contextual penalty θ (1.0 disables)")
    p.add_argument("--penalty-window", type=int, help="tokens the penalty looks back over (W)")
    p.add_argument("--seed", type=int, default=0)


def add_tokenswift_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-mode", choices=["fused", "separate"], default=None)
    p.add_argument("--tree-budget", type=int, default=None,
                   help="tree nodes verified at most per step (default: 4 on a CPU, 16 on CUDA)")
    p.add_argument("--draft-depth", type=int, default=None,
                   help="tree levels the model's drafters fill; deeper ones come from n-gram chains (default on a "
                        "CPU: the root head's levels, plus the backbone's in separate mode; on CUDA every level)")
    p.add_argument("--kv-budget", type=int, default=None, help="partial KV cache size for the separate draft pass")
    p.add_argument("--ngram-lag", type=int, default=None, help="leave the last N tokens out of the n-gram table")
    p.add_argument("--ngram-topk", type=int, default=None,
                   help="n-gram continuations proposed per key, at most (default 20, and never more than the tree's "
                        "nodes below the root; 0 turns token reuse off)")
    p.add_argument("--min-draft-score", type=float, default=None,
                   help="verify only drafts whose calibrated chance is at least this (default on a CPU: 0.25 with "
                        "AVX-512 kernels or PyTorch's operators, 0.45 with AVX2 kernels, 1 with plain C++ ones; 0 "
                        "on CUDA)")


def sampling_from(args: argparse.Namespace) -> SamplingSettings:
    """The preset `--preset` names with the flags given over it."""
    s = PRESETS[args.preset].with_(seed=args.seed)
    for name in ("temperature", "top_p", "top_k", "min_p", "penalty", "penalty_window"):
        value = getattr(args, name)
        if value is not None:
            s = s.with_(**{name: value})
    return s.validate()


def options_from(args: argparse.Namespace) -> TokenSwiftOptions:
    """TokenSwift's options from the flags given (the rest stay None: the engine's device defaults)."""
    opts = TokenSwiftOptions()
    for name in ("draft_mode", "tree_budget", "draft_depth", "kv_budget", "ngram_lag", "ngram_topk",
                 "min_draft_score"):
        value = getattr(args, name, None)
        if value is not None:
            opts = replace(opts, **{name: value})
    return opts.validate()


def load_engine(args: argparse.Namespace) -> Engine:
    """The engine the model flags describe."""
    heads = None if args.heads == "none" else args.heads
    return Engine.load(args.model, heads=heads, device=args.device, options=options_from(args), compile=args.compile,
                       weights=args.weights)
