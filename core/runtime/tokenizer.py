"""A checkpoint's tokenizer read with the `tokenizers` library alone, and its chat template rendered with jinja2.

transformers' tokenizer classes wrap the same `tokenizers` object but bring all of transformers with them (and,
through it, torch._dynamo and sympy): far more memory than the tokenizer itself. For a folder whose tokenizer.json is
the whole tokenizer, as transformers saves it (`tokenizer_class` TokenizersBackend: our GGUF conversions, the tiny
test checkpoints), `PlainTokenizer` gives the same ids, text and chat prompts as transformers' `AutoTokenizer`;
`plain_tokenizer` returns None for any other folder, which then loads through transformers.

The conditions mirror what transformers 5 does on top of tokenizer.json (TokenizersBackend.__init__): it adds the
special tokens of tokenizer_config.json that tokenizer.json lacks, replaces a missing post-processor, patches the
pre-tokenizer of a vocabulary over 100K ids, and honours `split_special_tokens` and extra templates. A folder that
would need any of that is left to transformers.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PLAIN_CLASSES = ("TokenizersBackend",)
MAX_PLAIN_VOCAB = 100_000  # above it transformers may patch a Mistral pre-tokenizer
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own template extension


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json states it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _plain_settings(folder: Path) -> dict[str, Any] | None:
    """tokenizer_config.json, if the folder's tokenizer.json is all of its tokenizer (see the module's doc)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    added = {t.get("content") for t in spec.get("added_tokens") or []}
    named = [_token_text(config.get(k)) for k in SPECIAL_TOKENS if config.get(k) is not None]
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    plain = (config.get("tokenizer_class") in PLAIN_CLASSES and not config.get("split_special_tokens")
             and not config.get("added_tokens_decoder") and spec.get("post_processor") is not None
             and spec.get("truncation") is None and spec.get("padding") is None
             and len((spec.get("model") or {}).get("vocab") or ()) <= MAX_PLAIN_VOCAB
             and isinstance(extra, list) and all(t in added for t in named + [_token_text(t) for t in extra])
             and isinstance(config.get("chat_template", ""), str)
             and not list(folder.glob("chat_template_*.jinja")) and not (folder / "additional_chat_templates").exists())
    template = folder / "chat_template.jinja"
    template_text = template.read_text(encoding="utf-8") if template.is_file() else config.get("chat_template") or ""
    return config if plain and not GENERATION_TAG.search(template_text) else None


def plain_tokenizer(folder: Path) -> PlainTokenizer | None:
    """The folder's tokenizer without transformers, or None where only transformers reads it as it should be."""
    config = _plain_settings(folder)
    return None if config is None else PlainTokenizer(folder, config)


class PlainTokenizer:
    """The parts of transformers' tokenizer interface the engine, the studio and the tools use."""

    def __init__(self, folder: Path, config: dict[str, Any]):
        from tokenizers import Tokenizer

        self.folder = folder
        self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = (template.read_text(encoding="utf-8") if template.is_file()
                                          else config.get("chat_template"))
        self.special_tokens_map = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        self.all_special_tokens = list(dict.fromkeys([*self.special_tokens_map.values(), *map(_token_text, extra)]))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._template = None

    def __getattr__(self, name: str) -> Any:
        # bos_token_id, eos_token_id, pad_token_id, ...: the id of a named special token, or None
        if name.endswith("_token_id") and name[:-3] in SPECIAL_TOKENS:
            token = self.special_tokens_map.get(name[:-3])
            return None if token is None else self.backend.token_to_id(token)
        if name in SPECIAL_TOKENS:
            return self.special_tokens_map.get(name)
        raise AttributeError(name)

    @property
    def backend_tokenizer(self) -> Any:
        """The `tokenizers` object itself, as transformers' fast tokenizers expose it."""
        return self.backend

    @property
    def all_special_ids(self) -> list[int]:
        return [self.backend.token_to_id(t) for t in self.all_special_tokens]

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False,
                 **_: Any) -> dict[str, list]:
        if not isinstance(text, str):
            raise TypeError("PlainTokenizer encodes one string at a time")
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        out: dict[str, list] = {"input_ids": list(enc.ids), "attention_mask": list(enc.attention_mask)}
        if return_offsets_mapping:
            out["offset_mapping"] = list(enc.offsets)
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **_: Any) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        # transformers skips the clean-up for a BPE model: it would strip real spaces before punctuation
        if clean and type(self.backend.model).__name__ != "BPE":
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """The conversation rendered as transformers renders it (same environment and variables), then encoded
        without added special tokens (the template writes them)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self._compiled().render(messages=messages, tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt,
                                       **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _compiled(self) -> Any:
        if self._template is None:
            self._template = compile_template(self.chat_template)
        return self._template

    def save_pretrained(self, folder: str | Path) -> None:
        """The tokenizer's files, copied: the folder then loads as this one does."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, folder / name)


def compile_template(source: str) -> Any:
    """A chat template in the environment transformers renders chat templates in (a sandbox, trimmed blocks, loop
    controls, its tojson, raise_exception and strftime_now), so a template writes the same text."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
