"""Every design citation in the code names a section of docs/design.md that exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUMBER = r"§\d+(?:\.\d+)*"
CHAIN = re.compile(rf"\b(ARCHITECTURE|M2|protocols) {NUMBER}(?:(?:, | and |, and |/){NUMBER})*")
DECISION = re.compile(r"\bD(\d{1,2})\b")


def _sources() -> list[Path]:
    roots = [REPO / "polygateway-core" / "src", *sorted((REPO / "plugins").glob("*/src"))]
    return [path for root in roots for path in sorted(root.rglob("*.py"))]


def _headings() -> set[str]:
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    return {line[4:].strip() for line in text.splitlines() if line.startswith("### ")}


def test_every_citation_has_its_section() -> None:
    headings = _headings()
    missing: list[str] = []
    bare: list[str] = []
    cited: set[str] = set()
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(REPO)
        for match in CHAIN.finditer(text):
            prefix = match.group(1)
            for number in re.findall(NUMBER, match.group(0)):
                name = f"{prefix} {number.rstrip('.')}"
                cited.add(name)
                if name not in headings:
                    missing.append(f"{where}: {name}")
        rest = CHAIN.sub("", text)
        bare += [f"{where}: {m.group(0)}" for m in re.finditer(rf".{{0,20}}{NUMBER}", rest)]
        for number in DECISION.findall(text):
            name = f"D{number}"
            cited.add(name)
            if name not in headings:
                missing.append(f"{where}: {name}")
    assert not bare, f"citations without ARCHITECTURE/M2/protocols: {bare}"
    assert not missing, f"cited but not in docs/design.md: {sorted(set(missing))}"
    assert {"D14", "ARCHITECTURE §7.8", "M2 §10"} <= cited  # the check saw real citations
