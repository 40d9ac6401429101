"""Every results file that the README and docs/ name (in backticks) is in the repository, so each figure
they quote can be traced to the file it came from."""

import re
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
