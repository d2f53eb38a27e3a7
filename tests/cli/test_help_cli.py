"""Every ``pgw`` command's ``--help`` (real CLI, subprocess): a description, every option
explained, defaults shown, and the same flag names for the same files across commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_telemetry_cli import clean_env

COMMANDS = [
    ("demo",),
    ("chat",),
    ("plugins", "list"),
    ("config", "check"),
    ("telemetry", "report"),
    ("logs",),
    ("logs", "show"),
    ("logs", "path"),
    ("fake-upstream",),
]
READS_CONFIGURATION = [("chat",), ("config", "check"), ("telemetry", "report"), ("logs",)]


def help_of(tmp_path: Path, *command: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "polygateway", *command, "--help"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def undocumented(text: str) -> list[str]:
    """Option lines with no help text on them or on the next line."""
    lines = text.splitlines()
    bare = []
    for index, line in enumerate(lines):
        match = re.match(r"^  (-[^ ].*?)(?:  +(\S.*))?$", line)
        if not match or match.group(2):
            continue
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if not re.match(r"^ {8,}\S", following):
            bare.append(match.group(1))
    return [b for b in bare if not b.startswith("-h")]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_describes_the_command_and_every_option(tmp_path: Path, command: tuple[str]) -> None:
    text = help_of(tmp_path, *command)
    body = text.split("\n\n", 2)
    assert len(body) >= 2 and body[1].strip() and not body[1].startswith("options:"), text
    assert undocumented(text) == [], text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_defaults_are_shown(tmp_path: Path) -> None:
    demo = help_of(tmp_path, "demo")
    for default in ("(default: 300)", "(default: 32)", "(default: 7)", "pgw_demo_telemetry.db"):
        assert default in demo
    assert "(default: 3)" in help_of(tmp_path, "logs")
    assert "(default: model)" in help_of(tmp_path, "telemetry", "report")
    assert "(default: LLM)" in help_of(tmp_path, "chat")


@pytest.mark.parametrize("command", READS_CONFIGURATION, ids=" ".join)
def test_one_flag_name_per_file(tmp_path: Path, command: tuple[str]) -> None:
    text = help_of(tmp_path, *command)
    assert "--config PATH" in text and "--env-file PATH" in text
    assert "--file" not in text and "--pipeline" not in text
