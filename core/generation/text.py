"""Text in and out of token ids: chat-template prompts, and incremental detokenisation for streaming."""
from __future__ import annotations

import codecs
import weakref
from array import array
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


def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet's inverse (GPT-2's bytes_to_unicode): each printable stand-in character -> its byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


class BytePieces:
    """Each token id's bytes, in one buffer (a list of bytes objects would take several times the memory)."""

    def __init__(self, blob: bytes, starts: array):
        self.blob = blob
        self.starts = starts  # id i's bytes are blob[starts[i]:starts[i + 1]]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> bytes:
        return self.blob[self.starts[i]:self.starts[i + 1]]

    def join(self, ids: list[int]) -> bytes:
        """The ids' bytes, one after another; an id past the vocabulary (a padded embedding's) has none, as the
        tokenizer decodes it."""
        blob, starts = self.blob, self.starts
        if max(ids, default=0) < len(starts) - 1:
            return b"".join([blob[starts[i]:starts[i + 1]] for i in ids])
        return b"".join([blob[starts[i]:starts[i + 1]] for i in ids if i < len(starts) - 1])


_PIECES: weakref.WeakKeyDictionary[Any, BytePieces | None] = weakref.WeakKeyDictionary()


def byte_pieces(tokenizer: Any) -> BytePieces | None:
    """Each token id's bytes (none for a special token), where the tokenizer's decoding is exactly "join the ids'
    bytes, then UTF-8 with U+FFFD for what is invalid" (a byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM2, as the
    `tokenizers` ByteLevel decoder decodes it, skipping special tokens); None for any other tokenizer. Built once per
    tokenizer, and checked against the tokenizer's own decoding of its added tokens and a sample of the vocabulary."""
    try:
        return _PIECES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: built each time
        return _build_pieces(tokenizer)
    pieces = _PIECES[tokenizer] = _build_pieces(tokenizer)
    return pieces


def _build_pieces(tokenizer: Any) -> BytePieces | None:
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    added = backend.get_added_tokens_decoder()
    to_byte = _byte_decoder()
    blob, starts = bytearray(), array("q", [0])
    for i in range(backend.get_vocab_size(with_added_tokens=True)):  # one token at a time: no vocabulary-sized dict
        token = backend.id_to_token(i)
        if token is not None and not (i in added and added[i].special):
            try:  # as the ByteLevel decoder does: the token's stand-ins as bytes, or, if any is none, its own UTF-8
                blob += bytes(to_byte[c] for c in token)
            except KeyError:
                blob += token.encode()
        starts.append(len(blob))
    pieces = BytePieces(bytes(blob), starts)
    for i in [*added, *range(0, len(pieces), max(1, len(pieces) // 512))]:
        if pieces[i].decode(errors="replace") != tokenizer.decode([i], skip_special_tokens=True,
                                                                    clean_up_tokenization_spaces=False):
            return None
    return pieces


class TextStream:
    """Turns a growing list of token ids into text deltas without re-decoding the whole text each step, holding
    back an incomplete UTF-8 character at the end, as streaming servers do: byte-level tokens can split one
    character over two ids.

    A byte-level tokenizer's ids are turned into their bytes (byte_pieces) and those through an incremental UTF-8
    decoder: a lookup per id, not a call of the tokenizer, which between two forwards costs far more. Any other
    tokenizer (`by_bytes` False, or none to be had) decodes a short window behind the newest tokens and holds back
    a delta that ends in U+FFFD.
    """

    def __init__(self, tokenizer: Any, by_bytes: bool = True):
        self.tokenizer = tokenizer
        self.pieces = byte_pieces(tokenizer) if by_bytes else None
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []
        self.prefix = 0  # start of the window that is decoded again for context
        self.read = 0  # ids up to here have been turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int]) -> str:
        """The text the new ids complete."""
        if self.pieces is not None:
            return self.utf8.decode(self.pieces.join(new_ids))
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
        return delta

    @property
    def holding(self) -> bool:
        """Whether the bytes of an unfinished character are held back."""
        return bool(self.utf8.getstate()[0]) if self.pieces is not None else self.read < len(self.ids)

    def flush(self) -> str:
        """Whatever is held back, at the end of a generation."""
        if self.pieces is not None:
            return self.utf8.decode(b"", final=True)
        full = self._decode(self.ids[self.prefix:])
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        delta = full[len(prefix_text):]
        self.prefix = self.read = len(self.ids)
        return delta
