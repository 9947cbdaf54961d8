"""`python -m core generate`: the text streamed, the summary, and the bandwidth its steps achieved beside the rate
this CPU reads memory (core/tools/roofline.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from core.generation.text import encode_prompt
from core.runtime.loading import load_model
from core.tools.cli import main
from core.tools.roofline import step_bytes

PROMPT = "Write about rivers."


def test_generate_reports_the_bandwidth_its_steps_achieved(tiny_model_dir: Path, capsys) -> None:
    """The JSON's bandwidth is the bytes every step had to read (the weights and the cache of the sequence before its
    token, once; the last token is drawn from the forward before it) over the decode time; the text summary says it
    beside the CPU's read rate."""
    args = ["generate", "--model", str(tiny_model_dir), "--heads", "none", "--device", "cpu", "--method", "ar",
            "--prompt", PROMPT, "--max-new-tokens", "24", "--ignore-eos", "--quiet"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_tokens"] == 24 and out["read_gb_s"] > 0
    loaded = load_model(str(tiny_model_dir))
    prompt = len(encode_prompt(loaded.tokenizer, PROMPT))
    read = sum(step_bytes(loaded.model, prompt + i) for i in range(23))
    assert out["bytes_read"] == read and out["bandwidth_gb_s"] == float(f"{read / out['decode_s'] / 1e9:.3g}")

    assert main(args) == 0
    err = capsys.readouterr().err
    achieved = re.search(r"bandwidth achieved: ([\d.]+) GB/s \(.*\), (\d+)% of the ([\d.]+) GB/s this CPU reads", err)
    assert achieved, err
    assert float(achieved[1]) > 0 and float(achieved[3]) > 0
    assert abs(int(achieved[2]) - 100 * float(achieved[1]) / float(achieved[3])) <= 1  # (each rounded for print)
