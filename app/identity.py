"""Who is writing: the owner string that scopes every project, comparison and run of a multi-user studio.

A signed-in Hugging Face user is ``hf:<username>``. Anyone else is known by a secret key made on their first visit
and kept in their browser (``gr.BrowserState``); only its hash reaches the database (``key:<sha256>``), so the
database alone cannot be used to act as a writer. A single-user studio has one writer, ``storage.LOCAL_OWNER``.
"""
from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any

KEY_BYTES = 32
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{43}")  # secrets.token_urlsafe(32)
MAX_USERNAME = 90  # the owner column holds 100 characters, "hf:" included


class IdentityError(ValueError):
    """A writer key or profile that cannot name a writer."""


def new_key() -> str:
    """A fresh browser key (43 URL-safe characters, 256 random bits)."""
    return secrets.token_urlsafe(KEY_BYTES)


def key_owner(key: str) -> str:
    """The owner string of a browser key; IdentityError for anything that is not a key this studio made."""
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise IdentityError("This writer key is not valid (a key is 43 letters, digits, '-' or '_'). "
                            "Reload the page to get a new one; projects made with another key stay with it.")
    return "key:" + hashlib.sha256(key.encode()).hexdigest()


def profile_owner(profile: Any) -> str:
    """The owner string of a signed-in Hugging Face profile (anything with a ``username``)."""
    username = getattr(profile, "username", None)
    if not isinstance(username, str) or not username.strip() or len(username) > MAX_USERNAME:
        raise IdentityError("The sign-in did not name a user; sign in again.")
    return "hf:" + username.strip()


def resolve(key: Any, profile: Any = None) -> tuple[str, str | None]:
    """The writer of a visit and the browser key to keep: ``(owner, key)``.

    A signed-in profile wins; else the browser's key; a browser without one gets a new key (returned, for the page
    to store). A malformed key raises IdentityError rather than silently replacing it.
    """
    if not key:
        key = new_key()
    owner_of_key = key_owner(key)
    return (profile_owner(profile) if profile is not None else owner_of_key), key
