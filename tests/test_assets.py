"""Sanity checks for the hand-written prompt assets (no model needed)."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "assets" / "prompts" / "train_prompts.jsonl"
BENCH = ROOT / "assets" / "bench_prompts.jsonl"
KINDS = {"novel", "report", "essay", "letter", "technical", "story",
         "article", "speech", "review", "other"}


def _load(path):
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                assert isinstance(row, dict), f"{path.name}:{n} is not an object"
                rows.append(row)
    return rows


def _words(text):
    return re.sub(r"[^a-z0-9\s]", " ", text.lower()).split()


def _grams(text, n=5):
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def _check_rows(rows, id_re):
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate ids"
    for r in rows:
        assert re.fullmatch(id_re, r["id"]), r["id"]
        assert r["kind"] in KINDS, r
        assert isinstance(r["prompt"], str) and len(r["prompt"].split()) >= 8, r


def test_train_prompts():
    rows = _load(TRAIN)
    _check_rows(rows, r"train-\d{4}")
    assert len(rows) >= 200
    assert len({r["kind"] for r in rows}) >= 6
    assert all(isinstance(r.get("genre"), str) and r["genre"] for r in rows)
    prompts = [" ".join(_words(r["prompt"])) for r in rows]
    assert len(prompts) == len(set(prompts)), "duplicate training prompts"


def test_bench_prompts():
    rows = _load(BENCH)
    _check_rows(rows, r"bench-\d{2}")
    assert len(rows) >= 8


def test_bench_disjoint_from_train():
    train_grams = set()
    for r in _load(TRAIN):
        train_grams |= _grams(r["prompt"])
    for r in _load(BENCH):
        shared = _grams(r["prompt"]) & train_grams
        assert not shared, f"{r['id']} shares 5-grams with training prompts: {sorted(shared)[:3]}"
