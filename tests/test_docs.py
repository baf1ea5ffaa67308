"""The README's headline table is generated from a report kept in the repo, never typed (#39 (8))."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def headline():
    spec = importlib.util.spec_from_file_location("headline", ROOT / "benchmarks" / "headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_headline_table_is_what_the_script_makes_of_the_kept_report():
    h = headline()
    kept = h.KEPT / "quickstart"
    assert (kept / "bench.json").is_file(), "run `python benchmarks/headline.py reports/quickstart --write`"
    readme = (ROOT / "README.md").read_text()
    assert h.readme_table(readme) == h.table(kept).strip()
    assert readme.index("## Commands") < len("\n".join(readme.splitlines()[:60]))  # within the first 60 lines
    assert len(readme.splitlines()) < 150
