"""Text in and out of token ids: chat-template prompts, and incremental detokenisation for streaming."""
from __future__ import annotations

from typing import Any

MAX_PROMPT_CHARS = 200_000


def encode_prompt(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids for `text`, as a user message under the model's chat template unless `chat` is False."""
    if not text or not text.strip():
        raise ValueError("the prompt is empty")
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt is {len(text)} characters long; the limit is {MAX_PROMPT_CHARS}")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


class TextStream:
    """Turns a growing list of token ids into text deltas without re-decoding the whole text each step.

    Decodes a short window behind the newest tokens and holds back a delta that ends in an incomplete UTF-8
    character (U+FFFD), as streaming servers do: byte-level tokens can split one character over two ids.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the window that is decoded again for context
        self.read = 0  # ids up to here have been turned into text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        # Hold back the trailing tokens of an incomplete character (at most 3 of a 4-byte one), not the whole push.
        for end in range(len(self.ids), max(self.read, len(self.ids) - 4), -1):
            full = self._decode(self.ids[self.prefix:end])
            if not full.endswith("\ufffd"):
                break
        else:
            return ""
        if len(full) <= len(prefix_text):
            return ""
        delta = full[len(prefix_text):]
        self.prefix, self.read = self.read, end
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is held back, at the end of a generation."""
        full = self._decode(self.ids[self.prefix:])
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        delta = full[len(prefix_text):]
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
