"""How the studio is hosted: single-user on a laptop, or shared (a Space, a team server) with private projects,
per-writer queue limits and a cap on run length, and where a Space keeps its database.

Read once at start-up from the command line and the environment (``app.py``); the UI receives a ``Hosting``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SPACE_VOLUME = Path("/data")  # a Space's persistent storage, when one is attached
SHARED_MAX_QUEUED = 2  # runs a writer may have waiting on a shared studio (a comparison is two)
SHARED_MAX_TOKENS = 4096


@dataclass(frozen=True)
class Hosting:
    """The sharing policy the UI enforces."""

    multi_user: bool = False
    max_queued: int | None = None  # per writer; None: no limit
    max_tokens: int | None = None  # per run; None: the model's context decides
    oauth: bool = False  # Hugging Face sign-in is configured (a Space with `hf_oauth: true`)
    storage_warning: str | None = None  # shown in the header: where text may be lost


def switch(name: str, value: str | None) -> bool | None:
    """An auto / on / off setting from the environment: None for auto; exits with a message naming ``name``."""
    value = (value or "auto").strip().lower()
    if value in ("auto", ""):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"app.py: {name} must be auto, 1 or 0, got {value!r}")


def _count(name: str, value: str | None, default: int | None) -> int | None:
    if value is None or not value.strip():
        return default
    if value.strip().lower() in ("0", "none", "off", "unlimited"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise SystemExit(f"app.py: {name} must be a whole number (0 = no limit), got {value!r}") from None
    if n < 0:
        raise SystemExit(f"app.py: {name} must be 0 or more, got {n}")
    return n


def space_database(env: Mapping[str, str], volume: Path = SPACE_VOLUME) -> str | None:
    """On a Space with persistent storage, the database file on it (None: not a Space, or no volume)."""
    if env.get("SPACE_ID") and volume.is_dir() and os.access(volume, os.W_OK):
        return str(volume / "studio.db")
    return None


def hosting_from(env: Mapping[str, str], *, host: str | None, multi_user: bool | None, db: str | None,
                 volume: Path = SPACE_VOLUME) -> Hosting:
    """The policy for a server bound to ``host`` using database ``db`` (as chosen, before defaults).

    Multi-user is on when asked (``--multi-user`` / ``TOKENSWIFT_MULTI_USER=1``), and by default on a Space or on a
    non-loopback interface. Limits apply to shared studios only, unless set explicitly.
    """
    on_space = bool(env.get("SPACE_ID"))
    shared = multi_user if multi_user is not None else switch("TOKENSWIFT_MULTI_USER",
                                                               env.get("TOKENSWIFT_MULTI_USER"))
    if shared is None:
        shared = on_space or (host is not None and host not in LOOPBACK)
    warning = None
    if on_space and db is None and space_database(env, volume) is None:
        warning = ("This Space has no persistent storage: everything written here is lost when it restarts. "
                   "Export your work, or ask the Space's owner to attach storage.")
    return Hosting(
        multi_user=shared,
        max_queued=_count("TOKENSWIFT_MAX_QUEUED", env.get("TOKENSWIFT_MAX_QUEUED"),
                          SHARED_MAX_QUEUED if shared else None),
        max_tokens=_count("TOKENSWIFT_MAX_TOKENS", env.get("TOKENSWIFT_MAX_TOKENS"),
                          SHARED_MAX_TOKENS if shared else None),
        oauth=shared and bool(env.get("OAUTH_CLIENT_ID")),
        storage_warning=warning,
    )
