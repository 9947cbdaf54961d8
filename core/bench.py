"""Benchmark (in progress)."""
import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="assets/bench_prompts.jsonl")


def run_bench(args: argparse.Namespace) -> int:
    raise RuntimeError("bench is not implemented yet")
