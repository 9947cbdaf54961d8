"""llama.cpp as the benchmark's CPU peer: the same GGUF file, prompt tokens, length and sampling, its decode speed
read from its own timing report.

`make bench-peers` builds it once from the llama-cpp-python sdist into TOKENSWIFT_CACHE/peers/llama.cpp
(TOKENSWIFT_LLAMA_CPP names another folder holding `llama-completion`). It is a benchmark dependency only.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from core.generation.sampling import SamplingSettings
from core.runtime.paths import cache_root

BUILD_HINT = "run `make bench-peers` to build it (about 10 minutes on 2 cores)"


def llama_cpp_binary() -> Path | None:
    """The llama-completion program, if it was built."""
    folder = Path(os.environ.get("TOKENSWIFT_LLAMA_CPP") or cache_root() / "peers" / "llama.cpp" / "bin")
    binary = folder / "llama-completion"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def sampling_flags(s: SamplingSettings) -> list[str]:
    """llama.cpp's samplers set to ours: every filter we do not use switched off (its defaults add top-k 40 and
    min-p 0.05); its repeat penalty is the same CTRL-style penalty over the last W tokens."""
    flags = ["--top-k", str(s.top_k), "--top-p", str(s.top_p), "--min-p", str(s.min_p), "--typical", "1.0",
             "--repeat-penalty", str(s.penalty), "--repeat-last-n", str(s.penalty_window), "--seed", str(s.seed)]
    return flags + ["--temp", str(s.temperature)]


def run_llama_cpp(binary: Path, gguf: Path, prompt: str, length: int, sampling: SamplingSettings,
                  threads: int) -> tuple[float, float, int]:
    """(decode tokens/s, prefill seconds, tokens generated) of one llama.cpp completion of `prompt` (text with the
    chat template already applied; its special tokens are parsed as such) to exactly `length` tokens."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(prompt)
        f.flush()
        cmd = [str(binary), "-m", str(gguf), "-f", f.name, "-n", str(length), "--ignore-eos", "-t", str(threads),
               "-c", str(length + 4096), "-no-cnv", "--no-warmup", *sampling_flags(sampling)]
        # the text goes nowhere (sampled text can end inside a UTF-8 character); the timings are on stderr
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=3600,
                              stdin=subprocess.DEVNULL)
    report = done.stderr.decode("utf-8", errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp failed ({done.returncode}): {report.strip().splitlines()[-1:]}")
    return parse_timings(report)


def parse_timings(report: str) -> tuple[float, float, int]:
    """(decode tokens/s, prefill seconds, decoded tokens) from llama.cpp's `llama_perf_context_print` lines."""
    prompt = re.search(r"prompt eval time =\s*([\d.]+) ms", report)
    decode = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", report.replace("prompt eval time", ""))
    if prompt is None or decode is None:
        raise RuntimeError("llama.cpp printed no timings (llama_perf_context_print)")
    ms, runs = float(decode.group(1)), int(decode.group(2))
    return runs / (ms / 1000), float(prompt.group(1)) / 1000, runs
