"""The layering contract (pyproject.toml, import-linter): app above core and storage, core in layers, no cycles."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": str(LINT.parent)})


def test_the_imports_keep_every_contract() -> None:
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_layer_importing_upwards_breaks_the_contract(tmp_path: Path) -> None:
    """The same check on a copy of the packages in which the n-gram table imports the engine (a layer above it)
    and the decode loop imports TokenSwift's step (a cycle): both are reported."""
    for package in ("app", "core", "storage"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.mako"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "core/tokenswift/ngram.py", "a") as f:
        f.write("\nfrom core.engine import METHODS  # noqa\n")
    with open(tmp_path / "core/generation/decoding.py", "a") as f:
        f.write("\nfrom core.tokenswift.step import tokenswift_steps  # noqa\n")
    done = lint(tmp_path)
    assert done.returncode != 0
    assert "core.tokenswift.ngram -> core.engine" in done.stdout
    assert "core.generation.decoding -> core.tokenswift.step" in done.stdout


def test_core_dodges_no_cycle_with_type_checking_imports() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "core").rglob("*.py") if "TYPE_CHECKING" in p.read_text()]
    assert offenders == []
