"""README stays a guide: small, and its Performance tables are exactly the committed runs (assets/bench/*.json)."""
from __future__ import annotations

import json
from pathlib import Path

from core.tools import bench, cost_curve

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_a_guide_not_a_notebook() -> None:
    assert len(README.encode()) <= 25 * 1024


def test_every_performance_table_is_its_committed_run() -> None:
    runs = sorted((ROOT / "assets" / "bench").glob("*.json"))
    assert runs, "no committed benchmark run"
    for path in runs:
        report = json.loads(path.read_text())
        render = bench.report_markdown if "settings" in report else cost_curve.report_markdown
        assert render(report) in README, (f"README's table for {path.name} differs from the run; paste the output of "
                                          f"`python -m core {'bench' if 'settings' in report else 'cost-curve'} "
                                          f"--markdown {path.relative_to(ROOT)}`")
    # and every table in the Performance section comes from one of them
    section = README.split("## Performance", 1)[1].split("\n## ", 1)[0]
    tables = [block for block in section.split("\n\n") if block.startswith("| ")]
    rendered = [json.loads(p.read_text()) for p in runs]
    assert len(tables) == len(rendered)
