"""docs/plugins.md documents every hook of polygateway.hookspecs with its exact signature."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from polygateway import hookspecs

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
# A hook is documented by a heading whose code span is its signature, e.g.
# ### `pgw_register_transports(register: Register) -> None`
HEADING = re.compile(r"^#{2,4} `(?P<name>pgw_\w+)(?P<signature>\(.*\)(?: -> .+)?)`\s*$", re.M)


def hook_specs() -> dict[str, Callable[..., Any]]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, marker)
    }


def source_signature(fn: Callable[..., Any]) -> str:
    """The signature as written in hookspecs.py (annotations are strings there)."""
    sig = inspect.signature(fn)
    params = ", ".join(
        f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name
        for p in sig.parameters.values()
    )
    returns = "" if sig.return_annotation is sig.empty else f" -> {sig.return_annotation}"
    return f"({params}){returns}"


def documented() -> dict[str, str]:
    text = DOCS.read_text(encoding="utf-8")
    found: dict[str, str] = {}
    for match in HEADING.finditer(text):
        assert match["name"] not in found, f"{match['name']} is documented twice"
        found[match["name"]] = match["signature"]
    return found


def test_hookspecs_are_found() -> None:
    specs = hook_specs()
    assert "pgw_register_transports" in specs
    assert set(specs) == set(hookspecs.HOOK_KINDS), "every hook needs a kind in HOOK_KINDS"


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_hook_is_documented_with_its_signature(name: str) -> None:
    docs = documented()
    assert name in docs, f"{name} is missing from docs/plugins.md"
    expected = source_signature(hook_specs()[name])
    assert docs[name] == expected, f"docs/plugins.md documents {name}{docs[name]}, not {expected}"


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_hook_section_names_its_kind(name: str) -> None:
    text = DOCS.read_text(encoding="utf-8")
    section = text.split(f"`{name}(", 1)[1].split("\n### ", 1)[0]
    assert f"Kind `{hookspecs.HOOK_KINDS[name]}`" in section
    assert "```python" in section, f"{name} needs an example"


def test_no_documented_hook_is_stale() -> None:
    stale = set(documented()) - set(hook_specs())
    assert not stale, f"docs/plugins.md documents hooks that do not exist: {sorted(stale)}"


def test_signature_rendering_detects_a_difference() -> None:
    def pgw_register_example(register: str, extra: int) -> None: ...

    assert source_signature(pgw_register_example) == "(register: str, extra: int) -> None"
