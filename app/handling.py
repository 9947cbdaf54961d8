"""What every UI handler shares: failures turned into a readable ``gr.Error`` (escaped: Gradio renders those as
HTML), never a traceback; and the ids a page or an API caller sends, checked before use.
"""
from __future__ import annotations

import functools
import html
import logging
from collections.abc import Callable
from typing import Any

import gradio as gr

import storage

log = logging.getLogger("app.ui")


def message(e: BaseException) -> str:
    return html.escape(str(e).strip() or type(e).__name__)


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn expected failures (bad input, missing rows) into a readable gr.Error; log unexpected ones."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except (storage.StorageError, ValueError) as e:
            raise gr.Error(message(e), print_exception=False) from None
        except Exception as e:
            log.exception("error in %s", fn.__name__)
            raise gr.Error(f"Something went wrong ({message(e)}). Details are in the server log.",
                           print_exception=False) from None
    return wrapper


def skip_none(value: Any) -> Any:
    return gr.skip() if value is None else value


def page_id(value: Any, what: str) -> int:
    """An id from the page or an API caller; a readable refusal for anything that is not one."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not number.is_integer() or number < 1 or isinstance(value, bool):
        raise gr.Error(f"{html.escape(str(value))[:40]} is not a valid {what} id.", print_exception=False)
    return int(number)


def owner_id(value: Any) -> int | None:
    """A hidden owner-id field's value (None/0 = not set, e.g. an API caller that does not send it)."""
    try:
        return int(value) or None
    except (TypeError, ValueError):
        return None
