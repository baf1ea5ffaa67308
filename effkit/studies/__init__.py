"""`effkit study NAME`: the classic distributed-training experiments, measured on this machine.

Every study runs real `effkit train` runs (multi-process ones through the same Accelerate launch as the CLI),
prints a table, and writes `reports/studies/NAME/NAME.json`, `NAME.md` and `NAME.png`.

A study is one module here holding its `STUDY` (`common.Study`: its name, help line, run and plot), named by one
line in `effkit.registry.STUDIES`; `common` holds what they share (`StudyConfig`, the training runs, `run_study`,
the Markdown). This package itself imports no torch: `names()` lists the studies for `--help` from the registry's
table, and `StudyConfig`, `fmt_value`, `run_study` and `Study` are imported from `common` when first asked for.
"""

from __future__ import annotations

from typing import Any

from effkit.registry import STUDIES

_FROM_COMMON = ("Study", "StudyConfig", "fmt_value", "run_study")

__all__ = ["STUDIES", "names", *_FROM_COMMON]


def names() -> tuple[str, ...]:
    """Every study's name, in the registry's order (no study module imported)."""
    return STUDIES.names()


def __getattr__(name: str) -> Any:
    if name in _FROM_COMMON:
        from effkit.studies import common

        return getattr(common, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
