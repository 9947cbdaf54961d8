"""What a load keeps resident, checked structurally: loading the default model imports neither transformers nor
torch._dynamo, sympy, the gguf package or torch's C++ extension tooling (nor does `generate` import the tools), and
each thing read without them reads what they read — the GGUF tensor table, the tokenizer's ids, offsets, text and
chat prompts, the config — while the quantizers and the lm_head's row selection give the same numbers with smaller
temporaries."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.runtime.gguf_file import read_table, read_tensor
from core.runtime.loading import ModelLoadError, gguf_source, plain_config, read_config, resolve
from core.runtime.model import ModelConfig
from core.runtime.tokenizer import PlainTokenizer, plain_tokenizer
from core.runtime.weights import _quantize_q4_1, _quantize_q8_0, pack, quantize_q4_1, quantize_q8_0
from core.tools.cli import TOOLS

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("transformers", "torch._dynamo", "sympy", "gguf", "torch.utils.cpp_extension")


def test_loading_the_default_model_imports_nothing_heavy() -> None:
    code = ("import sys\nfrom core.engine import Engine\nfrom core.generation.text import encode_prompt\n"
            "e = Engine.load(None)\nencode_prompt(e.tokenizer, 'Hello there.')\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_command_imports_only_its_own_tool() -> None:
    """`python -m core generate` carries none of the tools' modules (the benchmark's, the trainer's); a tool's
    command imports its own and takes its flags; the top-level help lists every command."""
    modules = [tool.module for tool in TOOLS.values()]
    probe = ("import sys\nfrom core.tools.cli import build_parser\nargv = sys.argv[1:]\n"
             f"build_parser(argv).parse_args(argv)\nprint([m for m in {modules!r} if m in sys.modules])")

    def imported(*argv: str) -> str:
        done = subprocess.run([sys.executable, "-c", probe, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    assert imported("generate", "--prompt", "x") == "[]"
    assert imported("cost-curve", "--sizes", "1,2") == "['core.tools.cost_curve']"
    assert imported("bench", "--lengths", "64", "--heads", "none") == "['core.tools.bench']"
    listing = subprocess.run([sys.executable, "-m", "core", "--help"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, check=True).stdout
    assert all(name in listing for name in ("generate", *TOOLS))


@pytest.fixture(scope="module")
def smol_folder() -> Path:
    return resolve("smollm2-135m")[0]


def test_the_gguf_table_is_the_gguf_readers(smol_folder: Path) -> None:
    import gguf

    path = gguf_source(smol_folder)
    assert path is not None
    table = read_table(path)
    reader = gguf.GGUFReader(str(path))
    assert list(table) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        entry = table[t.name]
        assert (entry.kind, entry.shape, entry.offset, entry.n_bytes) == (
            t.tensor_type.name, tuple(int(x) for x in t.shape), t.data_offset, t.n_bytes)
    for t in reader.tensors[:12]:
        data = read_tensor(path, table[t.name])
        assert data.dtype == t.data.dtype and data.shape == t.data.shape
        assert np.array_equal(data.view(np.uint8), np.asarray(t.data).view(np.uint8))


def test_a_written_gguf_reads_alike_every_metadata_kind_and_alignment(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_array("test.strings", ["a", "bé", ""])
    w.add_array("test.numbers", [1, 2, 3])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_bool("test.flag", True)
    w.add_float64("test.f64", 0.5)
    w.add_string("test.text", "ünïcode")
    w.add_tensor("a", np.arange(48, dtype=np.float32).reshape(3, 16))
    w.add_tensor("b", np.arange(10, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    table = read_table(path)
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        assert table[t.name].offset == t.data_offset and table[t.name].n_bytes == t.n_bytes
        assert np.array_equal(read_tensor(path, table[t.name]), t.data)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="truncated"):
        read_table(path)
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_table(path)


TEXTS = ["Hello world", " leading space", "trailing space ", "  two  spaces\n\nand lines\t", "Héllo wörld — ☃ 日本語 🎉",
         "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> special in text", "don't won't it's 1234567 3.14",
         "", " ", "\n", "x" * 300, "a<|im_end|>b"]


def random_texts(n: int = 200) -> list[str]:
    rnd = random.Random(0)
    alphabet = "abc xyz ÄÖü é\n\t.,!?'\"-0123456789日本☃🎉<|>_"
    return ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 80))) for _ in range(n)]


def test_the_plain_tokenizer_gives_transformers_ids_offsets_text_and_chat_prompts(smol_folder: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = plain_tokenizer(smol_folder), AutoTokenizer.from_pretrained(smol_folder)
    assert isinstance(ours, PlainTokenizer)
    for text in TEXTS + random_texts():
        for special in (True, False):
            mine = ours(text, add_special_tokens=special, return_offsets_mapping=True)
            ref = theirs(text, add_special_tokens=special, return_offsets_mapping=True)
            assert mine["input_ids"] == ref["input_ids"] and mine["offset_mapping"] == list(ref["offset_mapping"])
        ids = mine["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False) == \
                theirs.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    rnd = random.Random(1)
    for _ in range(100):
        ids = [rnd.randrange(len(ours)) for _ in range(rnd.randint(1, 30))]
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    chats = [[{"role": "user", "content": t}] for t in TEXTS[:8]]
    chats.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "A poem."}])
    for chat in chats:
        for prompt in (True, False):
            ref = theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True)
            ref = ref if isinstance(ref, list) else ref["input_ids"]
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True) == list(ref)
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False) == \
                theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
    assert ours.all_special_ids == theirs.all_special_ids
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_a_tokenizer_transformers_would_change_loads_through_transformers(smol_folder: Path, tmp_path: Path) -> None:
    ours = plain_tokenizer(smol_folder)
    assert ours is not None
    ours.save_pretrained(tmp_path / "copy")
    assert isinstance(plain_tokenizer(tmp_path / "copy"), PlainTokenizer)
    for change in ({"tokenizer_class": "LlamaTokenizer"}, {"split_special_tokens": True},
                   {"extra_special_tokens": ["<|not_in_vocab|>"]}):
        folder = tmp_path / "changed"
        shutil.rmtree(folder, ignore_errors=True)
        ours.save_pretrained(folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert plain_tokenizer(folder) is None, change


def test_a_plain_config_reads_as_transformers_reads_it(smol_folder: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from conftest import make_tiny_checkpoint

    folders = [smol_folder] + [make_tiny_checkpoint(tmp_path / arch, arch) for arch in ("llama", "qwen2", "mistral")]
    for folder in folders:
        raw = json.loads((folder / "config.json").read_text())
        assert plain_config(raw) is not None, folder
        assert ModelConfig.from_hf(read_config(folder)) == ModelConfig.from_hf(AutoConfig.from_pretrained(folder))
    raw = json.loads((smol_folder / "config.json").read_text())
    scaled = {**raw, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5}}
    assert plain_config(scaled) is None  # a scaling's parameters: transformers normalises them
    assert plain_config({k: v for k, v in raw.items() if k != "num_key_value_heads"}) is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="unreadable"):
        read_config(tmp_path / "bad")


def test_quantizing_by_rows_gives_the_numbers_of_one_pass() -> None:
    w = torch.randn(600, 96)
    for chunked, whole in ((quantize_q8_0(w), _quantize_q8_0(w)), (quantize_q4_1(w), _quantize_q4_1(w))):
        assert all(torch.equal(a, b) for a, b in zip(chunked, whole, strict=True))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_selected_rows_unpack_only_those_rows_with_the_same_numbers(fmt: str) -> None:
    packed = pack(torch.randn(200, 64), fmt)
    ids = torch.tensor([0, 5, 17, 199, 16, 31])
    for part, whole in zip(packed.blocks(ids), packed.blocks(), strict=True):
        assert part is None and whole is None or torch.equal(part, whole[ids])


def test_the_engine_packs_the_rows_drafting_scores_while_it_loads() -> None:
    """The root head's lm_head rows are packed while the engine loads, so that their transient copies go back to the
    system with the load's (release_freed_memory) instead of staying in the heap from the first step on; the three
    heads' rows, which fill no level by default, are not built at all."""
    from core.engine import Engine

    engine = Engine.load(None)
    assert engine.plan.root_drafting and not engine.plan.graph_heads
    scorers = engine.plan.heads._scorers
    assert set(scorers) == {"root_lm"} and scorers["root_lm"][0] is engine.model
