"""Head training (in progress)."""
import argparse


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)


def run_training(args: argparse.Namespace) -> int:
    raise RuntimeError("train-heads is not implemented yet")
