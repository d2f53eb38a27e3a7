"""Plugin hook specifications (pluggy project ``polygateway``, entry-point group ``polygateway``).

Every capability kind has one registration hook. Each hook receives a ``register(name, obj)``
callback (``polygateway.ports.Register``); call it once per thing the plugin provides. A
factory that takes options passes their model too, ``register(name, factory,
options=Model)`` (``polygateway.options``): the loader then validates the component's options
with it and the factory's ``ctx.options`` is the instance. Hooks run once per assembly, at startup;
requests never pass through pluggy. The core's own implementations register through these same
hooks (``polygateway.builtin``).

A minimal plugin module::

    from polygateway import hookimpl

    @hookimpl
    def pgw_register_transports(register):
        register("my-transport", MyTransport)   # MyTransport(source, providers) -> Transport

and in its ``pyproject.toml``::

    [project.entry-points.polygateway]
    my_plugin = "my_plugin"

Two plugins registering the same name for the same kind is an error naming both. Every hook
is documented in ``docs/plugins.md``.
"""

from __future__ import annotations

import pluggy

from polygateway.ports import Register

PROJECT_NAME = "polygateway"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# Hook name -> capability kind (the keys of ``provides`` in ``pgw plugins list --json``).
HOOK_KINDS: dict[str, str] = {
    "pgw_register_transports": "transport",
    "pgw_register_embedding_transports": "embedding_transport",
    "pgw_register_ocr_transports": "ocr_transport",
    "pgw_register_providers": "provider",
    "pgw_register_limiters": "limiter",
    "pgw_register_breakers": "breaker",
    "pgw_register_caches": "cache",
    "pgw_register_selectors": "selector",
    "pgw_register_structured": "structured",
    "pgw_register_pricing": "pricing",
    "pgw_register_telemetry": "telemetry",
    "pgw_register_telemetry_readers": "telemetry_reader",
    "pgw_register_middleware": "middleware",
    "pgw_register_commands": "command",
}


@hookspec
def pgw_register_transports(register: Register) -> None:
    """Register chat transports.

    :param register: ``register(name, factory)`` where ``factory(source: SourceConfig,
        providers: Mapping[str, ProviderProfile]) -> Transport``. Called once per source that
        names this transport (``{SCOPE}__{P}__{N}__TRANSPORT`` or ``transport = "..."`` in the
        pipeline file); one instance per source. ``providers`` holds every registered provider
        profile, so profiles added by other plugins reach the transport.
    """


@hookspec
def pgw_register_embedding_transports(register: Register) -> None:
    """Register embedding transports (the call kind of an embedding client).

    :param register: ``register(name, factory)`` where ``factory(source: SourceConfig) ->
        EmbeddingTransport`` (``embed(*, texts, source, call_id)`` and ``aclose()``). One
        instance per source that names this transport; an embedding client runs each batch
        through ``polygateway.governance.Governor`` with it.
    """


@hookspec
def pgw_register_ocr_transports(register: Register) -> None:
    """Register OCR transports (the call kind of an OCR client).

    :param register: ``register(name, factory)`` where ``factory(source: SourceConfig) ->
        OcrTextPort | OcrLayoutPort`` (one of them or both, plus ``aclose()``). One
        instance per source that names this transport; an OCR client runs each page through
        ``polygateway.governance.Governor`` with it.
    """


@hookspec
def pgw_register_providers(register: Register) -> None:
    """Register provider profiles (thinking parameters, reasoning fields, native schema).

    :param register: ``register(name, profile: ProviderProfile)``; ``name`` is what
        ``{SCOPE}__{PROVIDER}__{N}__...`` spells in lower case (``qwen``, ``deepseek``).
    """


@hookspec
def pgw_register_limiters(register: Register) -> None:
    """Register rate limiter backends.

    :param register: ``register(name, factory)`` with ``factory(ctx: BuildContext) ->
        RateLimiter``. Picked by ``PGW_LIMITER_BACKEND`` or ``[scope.limiter] name``.
    """


@hookspec
def pgw_register_breakers(register: Register) -> None:
    """Register circuit breaker backends.

    :param register: ``register(name, factory)`` with ``factory(ctx: BuildContext) ->
        ProviderGate``. Picked by ``PGW_BREAKER_BACKEND`` or ``[scope.breaker] backend``.
    """


@hookspec
def pgw_register_caches(register: Register) -> None:
    """Register response cache backends.

    :param register: ``register(name, factory)`` with ``factory(ctx: BuildContext) ->
        CacheBackend``. Picked by ``PGW_CACHE_BACKEND`` or ``[scope.cache] backend``.
    """


@hookspec
def pgw_register_selectors(register: Register) -> None:
    """Register source selection strategies.

    :param register: ``register(name, factory)`` with ``factory(ctx: BuildContext) ->
        SourceSelector``. Picked by ``{SCOPE}__SELECTOR`` or ``selector = "..."``.
    """


@hookspec
def pgw_register_structured(register: Register) -> None:
    """Register structured-output strategies.

    :param register: ``register(name, factory)`` with ``factory(ctx: BuildContext) ->
        StructuredOutputStrategy``.
    """


@hookspec
def pgw_register_pricing(register: Register) -> None:
    """Register pricing sources.

    :param register: ``register(name, factory)`` with ``factory(ctx: BuildContext) ->
        Pricing | None`` (``None`` when nothing is configured).
    """


@hookspec
def pgw_register_telemetry(register: Register) -> None:
    """Register telemetry recorders.

    :param register: ``register(name, factory)`` with ``factory(ctx: BuildContext) ->
        TelemetryRecorder``. Picked by ``PGW_TELEMETRY_BACKEND`` or ``[scope.telemetry]``.
    """


@hookspec
def pgw_register_telemetry_readers(register: Register) -> None:
    """Register readers of stored telemetry (what ``pgw telemetry report`` reads).

    :param register: ``register(name, reader)`` with ``reader(target: str, *, since: float |
        None) -> list[dict[str, Any]]``: every row (the 18 fields and ``created_at`` in epoch
        seconds) created at or after ``since``, oldest first. ``--db PATH`` reads with
        ``sqlite``; ``--dsn URL`` with the reader named by the URL's scheme (a ``+driver``
        suffix ignored). A target that cannot be read raises ``ValueError`` with a message
        naming the problem (never a password).
    """


@hookspec
def pgw_register_middleware(register: Register) -> None:
    """Register middleware layers the pipeline file can name in ``middleware = [...]``.

    :param register: ``register(name, factory)`` with ``factory(ctx: BuildContext) ->
        Middleware``; ``ctx.components`` holds the assembled parts. Order comes from the
        pipeline file, never from install order.
    """


@hookspec
def pgw_register_commands(register: Register) -> None:
    """Add ``pgw`` subcommands.

    :param register: ``register(name, factory)`` with ``factory(parser: argparse.
        ArgumentParser) -> Callable[[argparse.Namespace], int]``: configure the subcommand's
        arguments and return the function that runs it (returning the exit code).
    """
