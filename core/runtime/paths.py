"""Where the runtime keeps what it builds once: converted models, compiled kernels and graphs, training data."""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs

# The repository's assets folder (committed heads, prompts, benchmark results).
ASSETS = Path(__file__).resolve().parents[2] / "assets"


def cache_root() -> Path:
    """TOKENSWIFT_CACHE, else the user's cache folder (~/.cache/tokenswift)."""
    env = os.environ.get("TOKENSWIFT_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("tokenswift"))
