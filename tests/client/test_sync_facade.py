"""``polygateway.sync`` from a plain (non-async) script: answers through the fake upstream,
several threads at once, and a clean exit with or without close() (no unclosed-session or
destroyed-task warnings)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, threading
    from polygateway.settings import (
        CacheSettings, ScopeSettings, SourceConfig, TelemetrySettings,
    )
    from polygateway.sync import SyncGatewayClient
    from polygateway.errors import ClientClosedError
    from polygateway.testing import FakeUpstream, Reply

    with FakeUpstream.in_thread() as fake:
        fake.set_default("a", Reply.ok("sync answer"))
        settings = ScopeSettings(
            scope="LLM",
            sources=(SourceConfig(name="a", provider="openai", base_url=fake.base_url("a"),
                                  model="m", api_key="sk-sync-123"),),
            cache=CacheSettings(backend="none"),
            telemetry=TelemetrySettings(backend="none"),
        )
        client = SyncGatewayClient(settings)
        print(client.chat([{"role": "user", "content": "hi"}], temperature=0.1).content)
        answers = []
        threads = [
            threading.Thread(target=lambda: answers.append(
                client.chat([{"role": "user", "content": "x"}]).content))
            for _ in range(4)
        ]
        for t in threads: t.start()
        for t in threads: t.join()
        print(len(answers), set(answers))
        if sys.argv[1] == "close":
            client.close()
            try:
                client.chat([{"role": "user", "content": "late"}])
            except ClientClosedError:
                print("closed")
        print("requests", fake.requests("a"))
    # "leave": the client is still open here; interpreter exit closes it.
    """
)


@pytest.mark.parametrize("ending", ["close", "leave"])
def test_the_sync_facade_from_a_plain_script(ending: str) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", SCRIPT, ending],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[0] == "sync answer"
    assert lines[1] == "4 {'sync answer'}"
    assert ("closed" in lines) == (ending == "close")
    assert "requests 5" in done.stdout
    for bad in ("Unclosed", "ResourceWarning", "Task was destroyed", "Traceback"):
        assert bad not in done.stderr, done.stderr
