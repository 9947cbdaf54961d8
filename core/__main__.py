"""Command line: `python -m core generate | bench | cost-curve | train-heads` (see README for every flag)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: env TOKENSWIFT_MODEL or smollm2-135m)")
    p.add_argument("--heads", default="default",
                   help="drafting heads: 'default' (committed heads of a known model), 'none', or a file")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--compile", action="store_true", help="run the model through compiled fixed-size graphs")


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
                        "CPU with --compile: the root head's levels, plus the backbone's in separate mode; else every "
                        "level)")
    p.add_argument("--kv-budget", type=int, default=None, help="partial KV cache size for the separate draft pass")
    p.add_argument("--ngram-lag", type=int, default=None, help="leave the last N tokens out of the n-gram table")
    p.add_argument("--ngram-topk", type=int, default=None,
                   help="n-gram continuations proposed per key (default 20; 0 turns token reuse off)")
    p.add_argument("--min-draft-score", type=float, default=None,
                   help="verify only drafts whose calibrated chance is at least this (default: 0.25 on a CPU with "
                        "--compile, else 0)")


def sampling_from(args: argparse.Namespace):
    from core.sampling import PRESETS

    s = PRESETS[args.preset].with_(seed=args.seed)
    for name in ("temperature", "top_p", "top_k", "min_p", "penalty", "penalty_window"):
        value = getattr(args, name)
        if value is not None:
            s = s.with_(**{name: value})
    return s.validate()


def options_from(args: argparse.Namespace):
    from dataclasses import replace

    from core.tokenswift import TokenSwiftOptions

    opts = TokenSwiftOptions()
    for name in ("draft_mode", "tree_budget", "draft_depth", "kv_budget", "ngram_lag", "ngram_topk",
                 "min_draft_score"):
        value = getattr(args, name, None)
        if value is not None:
            opts = replace(opts, **{name: value})
    return opts.validate()


def load_engine(args: argparse.Namespace):
    from core.engine import Engine

    heads = None if args.heads == "none" else args.heads
    return Engine.load(args.model, heads=heads, device=args.device, options=options_from(args), compile=args.compile)


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from core.decoding import GenerationConfig
    from core.text import encode_prompt

    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of --prompt or --prompt-file")
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text(encoding="utf-8")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, method=args.method, sampling=sampling_from(args),
                              stop_strings=tuple(args.stop or ()), ignore_eos=args.ignore_eos).validate()
    engine = load_engine(args)
    prompt_ids = encode_prompt(engine.tokenizer, text, chat=not args.no_chat)
    gen = engine.generate(prompt_ids, config)
    bar = tqdm(total=config.max_new_tokens, unit="tok", file=sys.stderr, disable=args.quiet, dynamic_ncols=True)
    for step in gen:
        if not args.json:
            sys.stdout.write(step.text)
            sys.stdout.flush()
        bar.update(len(step.token_ids))
        bar.set_postfix_str(f"{step.tokens_per_s:.1f} tok/s")
    bar.close()
    result = gen.result
    assert result is not None
    for notice in engine.notices:
        print(f"note: {notice}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print()
        print(f"{result.n_tokens} tokens in {result.decode_s:.2f} s ({result.tokens_per_s:.1f} tok/s, prefill "
              f"{result.prefill_s:.2f} s); {result.mean_accepted:.2f} tokens/step, α={result.alpha():.3f}; "
              f"stopped: {result.stop_reason}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from core.bench import run_bench

    return run_bench(args)


def cmd_cost_curve(args: argparse.Namespace) -> int:
    from core.cost_curve import run_cost_curve

    return run_cost_curve(args)


def cmd_train_heads(args: argparse.Namespace) -> int:
    from core.train_heads import run_training

    return run_training(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m core", description="TokenSwift engine command line")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streamed to stdout")
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    g.add_argument("--no-chat", action="store_true", help="feed the prompt as plain text, without the chat template")
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--method", choices=["ar", "tokenswift"], default="tokenswift")
    g.add_argument("--ignore-eos", action="store_true", help="suppress end-of-sequence: exactly N tokens come out")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, timings, steps)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_args(g)
    add_sampling_args(g)
    add_tokenswift_args(g)
    g.set_defaults(func=cmd_generate)

    from core.bench import add_bench_args
    from core.train_heads import add_train_args

    b = sub.add_parser("bench", help="benchmark decoding methods side by side")
    add_bench_args(b)
    add_model_args(b)
    add_tokenswift_args(b)
    b.set_defaults(func=cmd_bench)

    from core.cost_curve import add_cost_curve_args

    c = sub.add_parser("cost-curve", help="time one forward of n new tokens over L cached ones (eager, compiled)")
    add_cost_curve_args(c)
    add_model_args(c)
    c.set_defaults(func=cmd_cost_curve)

    t = sub.add_parser("train-heads", help="train the drafting heads by self-distillation")
    add_train_args(t)
    t.set_defaults(func=cmd_train_heads)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as e:
        # Bad input and load failures end in one readable line, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
