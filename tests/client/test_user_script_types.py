"""mypy --strict on a user script written against the public call API: the parameters,
tool calls, the stream and the sync facade type-check, and misuse is a type error."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

GOOD = textwrap.dedent(
    """
    from polygateway import GatewayClient, LLMResponse, StreamDelta, ToolCall, assistant_message
    from polygateway.sync import SyncGatewayClient


    async def main(client: GatewayClient) -> str:
        tool = {"type": "function", "function": {"name": "f"}}
        response: LLMResponse = await client.chat(
            [{"role": "user", "content": "hi"}],
            temperature=0.2,
            max_tokens=100,
            stop=["END"],
            tools=[tool],
            tool_choice="auto",
            seed=1,
            model="other",
        )
        calls: tuple[ToolCall, ...] = response.tool_calls
        arguments: object = calls[0].parsed_arguments() if calls else None
        follow = [assistant_message(response)]
        async with client.stream(follow, restart_on_cut=True, top_p=0.9) as stream:
            async for delta in stream:
                piece: StreamDelta = delta
                text: str = piece.text
        final: LLMResponse = stream.response
        return final.content + str(arguments) + text


    def legacy() -> str:
        with SyncGatewayClient.from_env() as client:
            return client.chat([{"role": "user", "content": "hi"}], temperature=0.5).content
    """
)

BAD = textwrap.dedent(
    """
    from polygateway import GatewayClient


    async def main(client: GatewayClient) -> None:
        await client.chat([{"role": "user", "content": "hi"}], temperature="hot")
        async with client.stream([], max_tokens="many") as stream:
            pass
    """
)


TYPED = textwrap.dedent(
    """
    from typing import Any, reveal_type

    from pydantic import BaseModel

    from polygateway import GatewayClient, LLMResponse
    from polygateway.sync import SyncGatewayClient


    class Invoice(BaseModel):
        total: float


    async def main(client: GatewayClient) -> float:
        messages = [{"role": "user", "content": "bill"}]
        invoice = await client.chat(messages, structured=Invoice, temperature=0.0)
        reveal_type(invoice)
        reveal_type(invoice.structured_data)
        loose = await client.chat(messages, structured="json")
        reveal_type(loose.structured_data)
        plain = await client.chat(messages)
        reveal_type(plain.structured_data)
        untyped: LLMResponse = plain
        async with client.stream(messages, structured=Invoice, top_p=0.5) as stream:
            async for _ in stream:
                pass
        reveal_type(stream.response.structured_data)
        return invoice.structured_data.total + stream.response.structured_data.total


    def legacy(client: SyncGatewayClient) -> float:
        answer = client.chat([{"role": "user", "content": "bill"}], structured=Invoice)
        reveal_type(answer.structured_data)
        return answer.structured_data.total
    """
)

BAD_STRUCTURED = textwrap.dedent(
    """
    from polygateway import GatewayClient
    from polygateway.sync import SyncGatewayClient


    async def main(client: GatewayClient, legacy: SyncGatewayClient) -> None:
        await client.chat([{"role": "user", "content": "hi"}], structured=42)
        client.stream([], structured="yaml")
        legacy.chat([], structured=dict)
    """
)


def _mypy(tmp_path: Path, name: str, text: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / name
    script.write_text(text, encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )


def test_a_user_script_passes_mypy_strict(tmp_path: Path) -> None:
    done = _mypy(tmp_path, "good.py", GOOD)
    assert done.returncode == 0, done.stdout + done.stderr
    imported = subprocess.run(  # and every name it imports exists at runtime
        [sys.executable, "-c", "import good"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert imported.returncode == 0, imported.stderr


def test_wrong_argument_types_are_mypy_errors(tmp_path: Path) -> None:
    done = _mypy(tmp_path, "bad.py", BAD)
    assert done.returncode == 1
    assert '"temperature"' in done.stdout and '"max_tokens"' in done.stdout, done.stdout


def test_structured_results_are_typed_after_the_schema(tmp_path: Path) -> None:
    done = _mypy(tmp_path, "typed.py", TYPED)
    assert done.returncode == 0, done.stdout + done.stderr
    revealed = [
        line.split("Revealed type is ", 1)[1].strip('"')
        for line in done.stdout.splitlines()
        if "Revealed type is" in line
    ]
    assert revealed == [
        "polygateway.types.LLMResponse[typed.Invoice]",
        "typed.Invoice",
        "Any",
        "Any",
        "typed.Invoice",
        "typed.Invoice",
    ], done.stdout


def test_a_structured_spec_that_is_no_schema_is_a_mypy_error(tmp_path: Path) -> None:
    done = _mypy(tmp_path, "bad_structured.py", BAD_STRUCTURED)
    assert done.returncode == 1
    lines = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(lines) == 3, done.stdout
    assert 'Argument "structured" to "chat"' in lines[0], done.stdout
    assert 'Argument "structured" to "stream"' in lines[1], done.stdout
    assert 'Value of type variable "ModelT" of "chat"' in lines[2], done.stdout
