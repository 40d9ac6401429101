"""Every results file that the README and docs/ name (in backticks) is in the repository, and every
"ms (useful TFLOP/s)" cell of their tables is a figure some results file holds, so each figure they
quote can be traced to the file it came from."""

import json
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NAMED = re.compile(r"`([^`\s]+\.(?:md|json|csv|png|log|txt|diff))`")
# named in the docs but not results: a checkpoint directory's files, the trainer's output
NOT_RESULTS = {"config.json", "model.safetensors.index.json", "trainer.json"}


def named_results(text: str) -> list[str]:
    """The results files a page names: backticked file names, less the shorthand forms (``_run2.md``
    after the file it is a sibling of, patterns with ``*``, placeholders such as ``<stem>.json``), pages
    of the docs themselves and the names in NOT_RESULTS."""
    out = []
    for name in NAMED.findall(text):
        base = name.rsplit("/", 1)[-1]
        if base.startswith("_") or "*" in name or "<" in name or name.startswith("..."):
            continue
        if base in NOT_RESULTS or base == "README.md" or name.startswith("docs/") or (ROOT / "docs" / base).exists():
            continue
        out.append(name)
    return out


def missing_results(names: list[str]) -> list[str]:
    return [n for n in names if not any(p.exists() for p in (ROOT / n, RESULTS / n, RESULTS / "raw" / n))]


def test_the_docs_name_only_results_files_that_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {page.name: named_results(page.read_text()) for page in pages}
    assert sum(len(v) for v in named.values()) > 100  # the pages do cite their files
    missing = {page: missing_results(names) for page, names in named.items()}
    assert not any(missing.values()), {page: names for page, names in missing.items() if names}


def test_a_missing_results_file_is_reported():
    text = "see `attention_h200_s27_plan_cache.md`, `raw/no_such_run.log` and `_run2.md` (its sibling)"
    assert named_results(text) == ["attention_h200_s27_plan_cache.md", "raw/no_such_run.log"]
    assert missing_results(named_results(text)) == ["raw/no_such_run.log"]


# a table cell "34.0 (510)" or "**34.0 (510)**": milliseconds (useful TFLOP/s)
TIMING_CELL = re.compile(r"\|\s*\**(\d+(?:\.\d+)?) \((\d+)\)\**\s*(?=\|)")


@lru_cache(maxsize=1)
def _results():
    """(the text of every results markdown file, every (ms, TFLOP/s) pair of every results JSON row)."""
    text = "\n".join(p.read_text(errors="ignore") for p in sorted(RESULTS.rglob("*.md")))
    pairs = []
    for path in sorted(RESULTS.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        rows = data.get("rows", []) if isinstance(data, dict) else data if isinstance(data, list) else []
        for row in rows:
            for mode in ("fwd", "bwd", "fwdbwd"):
                ms, tflops = (row.get(f"{mode}_ms"), row.get(f"{mode}_tflops")) if isinstance(row, dict) else (0, 0)
                if isinstance(ms, (int, float)) and isinstance(tflops, (int, float)):
                    pairs.append((ms, tflops))
    return text, pairs


def unsourced_timings(text: str, results=None) -> list[str]:
    """The "ms (TFLOP/s)" cells of a page's tables that no results file holds: neither written so in a
    results markdown file nor, to the cell's rounding, a (ms, TFLOP/s) pair of a results JSON row."""
    results_text, pairs = results or _results()
    out = []
    for ms, tflops in TIMING_CELL.findall(text):
        if f"{ms} ({tflops})" in results_text:
            continue
        tol = 0.5 * 10 ** -(len(ms.split(".")[1]) if "." in ms else 0) + 1e-6
        if not any(abs(a - float(ms)) <= tol and abs(b - float(tflops)) <= 0.5 + 1e-6 for a, b in pairs):
            out.append(f"{ms} ({tflops})")
    return out


def test_every_timing_in_the_docs_tables_comes_from_a_results_file():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cells = {page.name: TIMING_CELL.findall(page.read_text()) for page in pages}
    assert sum(len(v) for v in cells.values()) > 100
    unsourced = {page.name: unsourced_timings(page.read_text()) for page in pages}
    assert not any(unsourced.values()), {page: v for page, v in unsourced.items() if v}


def test_an_unsourced_timing_is_reported():
    results = ("| 28, 4K, 2K | 34.0 (510) |", [(31.692, 585.47)])
    page = "| a | 34.0 (510) | 31.69 (585) | **31.7 (585)** | 31.8 (585) | 34.0 (511) |"
    assert unsourced_timings(page, results) == ["31.8 (585)", "34.0 (511)"]
