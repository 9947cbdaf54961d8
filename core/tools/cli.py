"""Command line: `python -m core generate | bench | cost-curve | long-profile | gpu-check | train-heads` (see README
for every flag)."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from core.engine import METHODS
from core.generation.decoding import GenerationConfig
from core.generation.text import encode_prompt
from core.runtime.loading import default_device
from core.tools.args import add_model_args, add_sampling_args, add_tokenswift_args, load_engine, sampling_from
from core.tools.roofline import read_rate_now, step_reads


class Tool(NamedTuple):
    """A subcommand run by a tool module of its own: `module` gives `add_args(parser)` and `run(args)`; `shared`
    adds the common flags after the tool's own."""
    module: str
    add_args: str
    run: str
    help: str
    shared: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()


# Imported only when named on the command line: a process that generates does not carry the benchmark's or the
# trainer's modules (nor their memory).
TOOLS = {
    "bench": Tool("core.tools.bench", "add_bench_args", "run_bench", "benchmark decoding methods side by side",
                  (add_model_args, add_tokenswift_args)),
    "cost-curve": Tool("core.tools.cost_curve", "add_cost_curve_args", "run_cost_curve",
                       "time one forward of n new tokens over L cached ones (eager, compiled)", (add_model_args,)),
    "long-profile": Tool("core.tools.long_profile", "add_long_profile_args", "run_long_profile",
                         "per-step overhead at up to 100K cached tokens (CPU, tiny random model)",
                         (add_tokenswift_args,)),
    "gpu-check": Tool("core.tools.gpu_check", "add_gpu_check_args", "run_gpu_check",
                      "the GPU check (make bench-gpu): cost curve, vanilla vs TokenSwift, exactness, on random "
                      "weights in real shapes; --device cpu: a dry run on tiny shapes"),
    "train-heads": Tool("core.tools.train_heads", "add_train_args", "run_training",
                        "train the drafting heads by self-distillation"),
}


def cmd_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of --prompt or --prompt-file")
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text(encoding="utf-8")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, method=args.method, sampling=sampling_from(args),
                              stop_strings=tuple(args.stop or ()), ignore_eos=args.ignore_eos).validate()
    # before the model loads: the measurement's buffer is freed before the model's memory is added to the process's
    read_rate = read_rate_now() if (args.device or default_device()).startswith("cpu") else None
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
    read = sum(step_reads(engine.model, len(prompt_ids), result.steps))
    achieved = read / result.decode_s if result.decode_s else 0.0
    if args.json:
        print(json.dumps({**result.to_json(), "bytes_read": read, "bandwidth_gb_s": float(f"{achieved / 1e9:.3g}"),
                          "read_gb_s": None if read_rate is None else float(f"{read_rate / 1e9:.3g}")}))
    else:
        print()
        print(f"{result.n_tokens} tokens in {result.decode_s:.2f} s ({result.tokens_per_s:.1f} tok/s, prefill "
              f"{result.prefill_s:.2f} s); {result.mean_accepted:.2f} tokens/step, α={result.alpha():.3f}; "
              f"stopped: {result.stop_reason}", file=sys.stderr)
        rate = "" if read_rate is None else (f", {achieved / read_rate:.0%} of the {read_rate / 1e9:.3g} GB/s this "
                                             "CPU reads")
        print(f"bandwidth achieved: {achieved / 1e9:.3g} GB/s (weights and cache read once a step){rate}",
              file=sys.stderr)
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; of the tools' subcommands only the one `argv` names gets its flags (and its
    module imported)."""
    parser = argparse.ArgumentParser(prog="python -m core", description="TokenSwift engine command line")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streamed to stdout")
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    g.add_argument("--no-chat", action="store_true", help="feed the prompt as plain text, without the chat template")
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--method", choices=list(METHODS), default="tokenswift")
    g.add_argument("--ignore-eos", action="store_true", help="suppress end-of-sequence: exactly N tokens come out")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, timings, steps)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_args(g)
    add_sampling_args(g)
    add_tokenswift_args(g)
    g.set_defaults(func=cmd_generate)

    named = next((a for a in argv or () if not a.startswith("-")), None)
    for name, tool in TOOLS.items():
        p = sub.add_parser(name, help=tool.help)
        if name == named:
            module = importlib.import_module(tool.module)
            getattr(module, tool.add_args)(p)
            for add in tool.shared:
                add(p)
            p.set_defaults(func=getattr(module, tool.run))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    args.command_line = "python -m core " + shlex.join(argv)  # recorded with a benchmark's figures
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as e:
        # Bad input and load failures end in one readable line, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
