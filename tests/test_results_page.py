"""docs/RESULTS.md is what scripts/results_page.py writes from docs/results/*.jsonl, and every record is complete."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from conftest import load_script as conftest_load_script

ROOT = Path(__file__).resolve().parent.parent


def load_script() -> ModuleType:
    """scripts/results_page.py as a module (no training, no torch: a few milliseconds)."""
    return conftest_load_script("results_page")


def test_every_record_has_the_required_fields() -> None:
    page = load_script()
    records = page.load_records()
    assert records, "no records under docs/results"
    problems = page.problems(records)
    assert not problems, "incomplete records (fields: " + ", ".join(page.REQUIRED) + "):\n" + "\n".join(problems)


def test_records_that_bench_scripts_read_agree_with_their_common_fields() -> None:
    """recipes.jsonl and quality-encoders.jsonl keep the fields their scripts read beside the common ones: the two
    must say the same thing."""
    for where, record in load_script().load_records():
        if "accuracy" in record and "row" in record:  # scripts/bench_recipes.py's records
            assert record["value"] == record["accuracy"], where
            assert record["interval"] == record["accuracy_ci"], where
        if "seed" in record:
            assert record["seeds"] == [record["seed"]], where
        if "ci" in record:  # scripts/bench_quality.py's records
            assert record["interval"] == record["ci"], where


def test_results_page_is_current() -> None:
    page = load_script()
    written = (ROOT / "docs" / "RESULTS.md").read_text()
    assert written == page.render(page.load_records()), "stale: run .venv/bin/python scripts/results_page.py"


def test_no_record_dates_its_work_by_sitting_or_issue() -> None:
    for path in sorted((ROOT / "docs" / "results").iterdir()):
        text = path.read_text().lower()
        for word in ('"session"', "session ", "issue "):
            assert word not in text, f"{path.name} mentions {word!r}"


def test_check_exits_1_on_a_stale_page_and_names_an_incomplete_record(tmp_path: Path) -> None:
    page = load_script()
    record = {
        "area": "resume",
        "what": "a row",
        "metric": "m",
        "value": 0.5,
        "interval": None,
        "seeds": [42],
        "hardware": "2-core CPU",
        "date": "2026-01-02",
        "commit": "abcdef1",
        "command": "true",
    }
    (tmp_path / "a.jsonl").write_text(json.dumps(record) + "\n")
    out = tmp_path / "RESULTS.md"
    assert page.main(["--records", str(tmp_path), "--page", str(out)]) == 0
    assert page.main(["--check", "--records", str(tmp_path), "--page", str(out)]) == 0
    assert "| a row | m | **0.5** |" in out.read_text()
    out.write_text(out.read_text() + "edited by hand\n")
    assert page.main(["--check", "--records", str(tmp_path), "--page", str(out)]) == 1
    del record["commit"]
    (tmp_path / "a.jsonl").write_text(json.dumps(record) + "\n")
    assert page.problems(page.load_records(tmp_path)) == ["a.jsonl:1: no `commit`"]
    assert page.main(["--check", "--records", str(tmp_path), "--page", str(out)]) == 1


def test_a_row_of_several_seeds_shows_the_middle_run() -> None:
    page = load_script()
    base = {"area": "accuracy", "what": "w", "metric": "accuracy", "hardware": "2-core CPU", "command": "c"}
    runs = [
        {**base, "value": 0.90, "interval": [0.88, 0.92], "seeds": [43], "date": "2026-01-02", "commit": "bbbbbbb"},
        {**base, "value": 0.86, "interval": [0.84, 0.88], "seeds": [42], "date": "2026-01-01", "commit": "aaaaaaa"},
        {**base, "value": 0.88, "interval": [0.86, 0.90], "seeds": [44], "date": "2026-01-02", "commit": "bbbbbbb"},
    ]
    row = page.row(runs)
    assert (row["value"], row["interval"], row["runs"]) == ("**0.88**", "[0.860, 0.900]", "0.86 / 0.9 / 0.88")
    assert (row["seeds"], row["date"], row["commit"]) == ("42, 43, 44", "2026-01-01 to 2026-01-02", "aaaaaaa, bbbbbbb")
