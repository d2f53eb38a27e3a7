"""The core's own implementations, registered through the same hooks as any plugin.

Imports are deferred into the factories so that ``import polygateway`` stays fast and a
capability that is never assembled is never imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from polygateway.hookspecs import hookimpl
from polygateway.ports import BuildContext, ComponentContext, ProviderProfile, Register
from polygateway.settings import SourceConfig

if TYPE_CHECKING:
    import argparse

    from polygateway.builtin_options import MemoryCacheOptions, SQLiteTelemetryOptions
    from polygateway.builtin_values import MemoryCacheValues, SQLiteTelemetryValues
    from polygateway.plugins import CommandFactory


@hookimpl
def pgw_register_transports(register: Register) -> None:
    def openai_compat(source: SourceConfig, providers: Mapping[str, ProviderProfile]) -> Any:
        from polygateway.transports.openai_compat import OpenAICompatTransport

        return OpenAICompatTransport(source, providers=providers)

    register("openai-compat", openai_compat)


@hookimpl
def pgw_register_providers(register: Register) -> None:
    from polygateway.providers import BUILTIN_PROFILES

    for profile in BUILTIN_PROFILES:
        register(profile.name, profile)


@hookimpl
def pgw_register_limiters(register: Register) -> None:
    def memory(ctx: BuildContext) -> Any:
        from polygateway.backends.memory.limiter import InMemoryLimiter

        return InMemoryLimiter(
            global_limits=ctx.settings.global_limits,
            lease_ttl_s=ctx.settings.lease_ttl_s,
            clock=ctx.clock,
            scope=ctx.settings.scope,
        )

    register("memory", memory)


@hookimpl
def pgw_register_breakers(register: Register) -> None:
    def memory(ctx: BuildContext) -> Any:
        from polygateway.backends.memory.breaker import InMemoryGate

        return InMemoryGate(
            fail_threshold=ctx.settings.breaker.fail_threshold,
            cooldown_s=ctx.settings.breaker.cooldown_s,
            probe_ttl_s=ctx.settings.probe_ttl_s,
            clock=ctx.clock,
            max_cooldown_s=ctx.settings.breaker.cooldown_cap_s,
            scope=ctx.settings.scope,
        )

    register("memory", memory)


@hookimpl
def pgw_register_caches(register: Register) -> None:
    # By reference, with a plain reader: the default configuration's cache needs no pydantic.
    from polygateway.builtin_values import MEMORY_CACHE_OPTIONS

    def memory(ctx: ComponentContext[MemoryCacheValues | MemoryCacheOptions]) -> Any:
        from polygateway.backends.memory.cache import MemoryCache

        return MemoryCache(clock=ctx.clock, max_entries=ctx.options.max_entries)

    register("memory", memory, options=MEMORY_CACHE_OPTIONS)


@hookimpl
def pgw_register_selectors(register: Register) -> None:
    def round_robin(ctx: BuildContext) -> Any:
        from polygateway.selectors import RoundRobinSelector

        return RoundRobinSelector()

    def least_inflight(ctx: BuildContext) -> Any:
        from polygateway.selectors import LeastInflightSelector

        return LeastInflightSelector()

    def priority(ctx: BuildContext) -> Any:
        from polygateway.selectors import PrioritySelector

        return PrioritySelector()

    def weighted(ctx: BuildContext) -> Any:
        from polygateway.selectors import WeightedSelector

        return WeightedSelector()

    register("round_robin", round_robin)
    register("least_inflight", least_inflight)
    register("priority", priority)
    register("weighted", weighted)


@hookimpl
def pgw_register_structured(register: Register) -> None:
    # ``normalize`` is the client's hook (``GatewayClient(normalize=...)``), handed over in
    # the options mapping.
    def auto(ctx: BuildContext) -> Any:
        from polygateway.structured.native_schema import NativeSchemaStrategy

        return NativeSchemaStrategy(ctx.options.get("normalize"))

    def json_repair(ctx: BuildContext) -> Any:
        from polygateway.structured.json_repair import JsonRepairStrategy

        return JsonRepairStrategy(ctx.options.get("normalize"))

    register("auto", auto)
    register("native-schema", auto)
    register("json-repair", json_repair)


@hookimpl
def pgw_register_pricing(register: Register) -> None:
    def table(ctx: BuildContext) -> Any:
        from polygateway.telemetry.pricing import PricingTable

        path = ctx.settings.pricing_path
        return PricingTable.from_file(path) if path else None

    register("table", table)


@hookimpl
def pgw_register_telemetry(register: Register) -> None:
    from polygateway.builtin_values import SQLITE_TELEMETRY_OPTIONS

    def sqlite(ctx: ComponentContext[SQLiteTelemetryValues | SQLiteTelemetryOptions]) -> Any:
        from polygateway.telemetry.sqlite import SQLiteRecorder

        options = ctx.options
        return SQLiteRecorder(
            ctx.settings.telemetry.sqlite_path,
            batch_size=options.batch_size,
            flush_interval_s=options.flush_interval_s,
            queue_max=options.queue_max,
        )

    register("sqlite", sqlite, options=SQLITE_TELEMETRY_OPTIONS)


@hookimpl
def pgw_register_telemetry_readers(register: Register) -> None:
    def sqlite(target: str, *, since: float | None) -> list[dict[str, Any]]:
        from polygateway.telemetry.report import read_sqlite_rows

        return read_sqlite_rows(target, since=since)

    register("sqlite", sqlite)


@hookimpl
def pgw_register_middleware(register: Register) -> None:
    from polygateway.middleware import builtin_layers

    for name, factory in builtin_layers().items():
        register(name, factory)


@hookimpl
def pgw_register_commands(register: Register) -> None:
    def lazy(module: str) -> CommandFactory:
        def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
            import importlib

            mod = importlib.import_module(module)
            configure_fn: Callable[
                [argparse.ArgumentParser], Callable[[argparse.Namespace], int]
            ] = mod.configure
            return configure_fn(parser)

        return configure

    register("plugins", lazy("polygateway.cli.plugins_cmd"))
    register("config", lazy("polygateway.cli.config_cmd"))
    register("chat", lazy("polygateway.cli.chat_cmd"))
    register("demo", lazy("polygateway.cli.demo_cmd"))
    register("telemetry", lazy("polygateway.cli.telemetry_cmd"))
    register("logs", lazy("polygateway.cli.logs_cmd"))
    register("fake-upstream", lazy("polygateway.cli.fake_upstream_cmd"))
