"""``pgw chat "text"``: one governed call with the configured sources."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polygateway.types import LLMResponse

from polygateway.cli import add_config_arguments


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.description = "One governed call with the configured sources."
    parser.add_argument("text", help="the user message")
    parser.add_argument("--scope", default="LLM", help="configuration scope")
    parser.add_argument("--system", help="an optional system message")
    parser.add_argument("--json", action="store_true", help="print the whole response as JSON")
    parser.add_argument("--no-stream", action="store_true", help="use the non-streaming API")
    add_config_arguments(parser)
    return run


def run(args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_chat(args))


async def _chat(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from polygateway import ConfigError, GatewayClient, PolyGatewayError

    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.text})
    try:
        client = GatewayClient.from_env(
            scope=args.scope, pipeline_path=args.pipeline_path, dotenv_path=args.env_file
        )
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config: {problem}", file=sys.stderr)
        return 2
    live = not args.json and not args.no_stream  # print tokens as they arrive
    async with client:
        try:
            if live:
                async with client.stream(messages) as stream:
                    async for delta in stream:
                        if delta.kind == "content":
                            sys.stdout.write(delta.text)
                            sys.stdout.flush()
                        elif delta.kind == "thinking":
                            sys.stderr.write(delta.text)
                        elif delta.kind == "restart":
                            sys.stdout.write("\n[restarted]\n")
                response = stream.response
            else:
                response = await client.chat(messages, stream=not args.no_stream)
        except PolyGatewayError as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    if live:
        print()
        _footer(response)
        return 0
    if args.json:
        data = dataclasses.asdict(response)
        data.pop("structured_data", None)
        print(json.dumps(data, ensure_ascii=False, indent=2))
    else:
        if response.thinking:
            print(f"[thinking] {response.thinking}\n", file=sys.stderr)
        print(response.content)
        _footer(response)
    return 0


def _footer(response: LLMResponse) -> None:
    print(
        f"[{response.source_name} {response.model} {response.latency_ms} ms "
        f"{response.prompt_tokens}+{response.completion_tokens} tokens"
        f"{' cache hit' if response.cache_hit else ''}]",
        file=sys.stderr,
    )
