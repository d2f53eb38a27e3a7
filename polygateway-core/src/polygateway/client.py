"""``GatewayClient``: one governed client per scope (logical role), and ``gather_bounded``.

    client = GatewayClient.from_env()            # scope "LLM"
    resp = await client.chat(messages)

Every part can be injected instead of built from the configuration. Sharing is explicit:
passing the same limiter (or breaker) instance to two clients makes them share its gates;
nothing is shared implicitly (ARCHITECTURE §7.7).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from os import PathLike
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypedDict, Unpack, overload

from typing_extensions import TypeVar

from polygateway.assembly import build_pipeline
from polygateway.chat.messages import check_message_shape
from polygateway.chat.stream import ChatStream
from polygateway.clock import SystemClock
from polygateway.context import CallContext
from polygateway.errors import (
    ClientClosedError,
    RequestRejectedError,
    StructuredSpecError,
)
from polygateway.governance import Governor
from polygateway.lifecycle import close_client_parts
from polygateway.params import ChatParams, check_params
from polygateway.ports import (
    CacheBackend,
    Clock,
    Components,
    Drainable,
    Handler,
    Pricing,
    ProviderGate,
    RateLimiter,
    SourceSelector,
    TelemetryRecorder,
    Transport,
)
from polygateway.settings import GatewaySettings, ScopeSettings
from polygateway.types import ChatRequest, LLMResponse, Message, StructuredSpec

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["GatewayClient", "Injected", "gather_bounded"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound="BaseModel", default=Any)
"""The model class of ``structured=`` (unsolved, i.e. ``"json"`` or ``None``: ``Any``)."""
StructuredArg: TypeAlias = type[ModelT] | Literal["json"] | None
"""What ``structured=`` accepts; the response's ``structured_data`` is typed after it."""


class ChatOptions(TypedDict, total=False):
    """The keywords of ``GatewayClient.chat`` other than ``structured`` and ``stream``."""

    session_id: str | None
    parent_call_id: str | None
    cache_salt: str | None
    cache_namespace: str | None
    model: str | None
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stop: str | Sequence[str] | None
    seed: int | None
    presence_penalty: float | None
    frequency_penalty: float | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool | None
    response_format: Mapping[str, Any] | None
    user: str | None
    extra_body: Mapping[str, Any] | None
    deadline_s: float | None


class Injected(TypedDict, total=False):
    """Parts a client can be given instead of building them (the caller keeps ownership)."""

    registry: Any
    clock: Clock
    limiter: RateLimiter
    breaker: ProviderGate
    cache: CacheBackend
    telemetry: TelemetryRecorder
    pricing: Pricing
    transports: Mapping[str, Transport]
    selector: SourceSelector
    normalize: Callable[[Any], Any] | None


class GatewayClient:
    """A governed chat client for one scope: the middleware onion, assembled once.

    Parts passed in stay the caller's: ``aclose()`` closes only what this client built
    (transports, limiter, breaker, cache, telemetry recorder), and flushes the telemetry
    recorder either way so a graceful shutdown loses no row.

    ``normalize`` is the structured strategy's hook for provider variants (rung ② of
    ARCHITECTURE §7.9): called with the parsed JSON of every ``structured=`` answer, it
    returns the data to validate (e.g. unwrap ``[{...}]``, regroup flattened arguments). A
    ``ConfigError`` if the configured strategy does not take one.
    """

    __slots__ = (
        "_closed",
        "_components",
        "_drains",
        "_governor",
        "_handler",
        "_owned",
        "_owns_telemetry",
        "_settings",
        "_structured_on",
    )

    def __init__(
        self,
        settings: ScopeSettings,
        *,
        registry: Any = None,
        clock: Clock | None = None,
        limiter: RateLimiter | None = None,
        breaker: ProviderGate | None = None,
        cache: CacheBackend | None = None,
        telemetry: TelemetryRecorder | None = None,
        pricing: Pricing | None = None,
        transports: Mapping[str, Transport] | None = None,
        selector: SourceSelector | None = None,
        normalize: Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(settings, ScopeSettings):
            raise TypeError(
                "GatewayClient needs the ScopeSettings of one scope; use "
                "GatewayClient.from_settings(settings, scope=...) for GatewaySettings"
            )
        if registry is None:
            from polygateway.plugins import load_registry

            registry = load_registry()
        pipeline = build_pipeline(
            settings,
            registry,
            clock=clock if clock is not None else SystemClock(),
            limiter=limiter,
            breaker=breaker,
            cache=cache,
            telemetry=telemetry,
            pricing=pricing,
            transports=transports,
            selector=selector,
            normalize=normalize,
        )
        components = pipeline.components
        self._settings = settings
        self._handler: Handler = pipeline.handler
        self._components = components
        # Layers that hand work to the background (telemetry rows) and can wait for it.
        self._drains = [layer.drain for layer in pipeline.layers if isinstance(layer, Drainable)]
        self._structured_on = "structured" in settings.middleware
        # What this client built and therefore closes, in closing order.
        self._governor = pipeline.dispatcher.governor
        owned: list[tuple[str, Any]] = [("health probes", self._governor)]
        owned += [
            (f"transport {name!r}", transport)
            for name, transport in components.transports.items()
            if transports is None or transports.get(name) is None
        ]
        if cache is None and components.cache is not None:
            owned.append(("cache", components.cache))
        if limiter is None:
            owned.append(("limiter", components.limiter))
        if breaker is None:
            owned.append(("breaker", components.breaker))
        self._owned: tuple[tuple[str, Any], ...] = tuple(owned)
        self._owns_telemetry = telemetry is None and components.telemetry is not None
        self._closed = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_env(
        cls,
        scope: str = "LLM",
        *,
        env: Mapping[str, str] | None = None,
        pipeline_path: str | PathLike[str] | None = None,
        dotenv_path: str | PathLike[str] | None = None,
        **injected: Unpack[Injected],
    ) -> GatewayClient:
        """Build the client of ``scope`` from the environment, ``.env`` and the pipeline file.

        ``env`` replaces ``os.environ`` (tests); plugins are filtered by ``PGW_PLUGINS`` (env,
        then ``.env``, then the file's ``plugins``), exactly as the ``pgw`` commands read it.
        """
        from polygateway.config import load_scope, plugin_filter

        registry = injected.get("registry")
        if registry is None:
            from polygateway.plugins import load_registry

            allowed = plugin_filter(env, dotenv_path=dotenv_path, pipeline_path=pipeline_path)
            registry = injected["registry"] = load_registry(allowed=allowed)
        # With the registry, the loader names unregistered implementations at the key.
        settings = load_scope(
            scope, env, pipeline_path=pipeline_path, dotenv_path=dotenv_path, registry=registry
        )
        return cls(settings, **injected)

    @classmethod
    def from_settings(
        cls,
        settings: GatewaySettings | ScopeSettings,
        scope: str = "LLM",
        **injected: Unpack[Injected],
    ) -> GatewayClient:
        """Build the client of ``scope`` from already resolved settings."""
        if isinstance(settings, GatewaySettings):
            settings = settings.scope(scope)
        return cls(settings, **injected)

    # ------------------------------------------------------------------ the call

    async def chat(
        self,
        messages: Sequence[Message],
        *,
        session_id: str | None = None,
        parent_call_id: str | None = None,
        cache_salt: str | None = None,
        cache_namespace: str | None = None,
        structured: StructuredArg[ModelT] = None,
        stream: bool = True,
        model: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: Mapping[str, Any] | None = None,
        user: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
    ) -> LLMResponse[ModelT]:
        """One governed chat call (ARCHITECTURE §5.2).

        :param deadline_s: end-to-end deadline across every attempt, backoff and admission
            wait (default: the scope's ``retry.call_deadline_s``); past it the call raises
            ``AllSourcesExhausted(reason="retry_exhausted")``.
        :param structured: ``None`` raw text, ``"json"`` repaired JSON in
            ``structured_data``, or a pydantic model class (the full D14 ladder); the result
            is typed after it (``structured=Invoice`` -> ``LLMResponse[Invoice]``, else
            ``LLMResponse[Any]``). Anything
            else is a type error, and a ``StructuredSpecError`` (a ``TypeError``) at runtime.
        The generation parameters (``model`` ... ``extra_body``, see ``polygateway.params``)
        override the source's defaults for this call, are sent through the provider profile
        (``max_tokens`` as ``max_completion_tokens`` for OpenAI) and are part of the cache key.
        :raises RequestRejectedError: malformed ``messages`` or a bad parameter (naming it),
            before any network; or the upstream refused the input (another attempt would too).
        :raises ScopeUnavailableError: (``AllSourcesExhausted``, ``CircuitOpenError``) no
            source can take the call now: retry the task after ``retry_after_s``; ``reason``
            and ``per_source_reasons`` say why. Timeouts and network faults end up here.
        :raises ResultInvalidError: the answer is unusable (the structured ladder failed).
        :raises ClientClosedError: the client was closed.
        :raises GovernanceBackendError: the limiter or breaker backend is down (fail closed).
        """
        # Positional, in ``_request``'s order: 21 keywords would be matched by name on every
        # call (a test keeps the two signatures and this call in step).
        request = self._request(
            messages,
            session_id,
            parent_call_id,
            cache_salt,
            cache_namespace,
            structured,
            stream,
            model,
            temperature,
            top_p,
            max_tokens,
            stop,
            seed,
            presence_penalty,
            frequency_penalty,
            tools,
            tool_choice,
            parallel_tool_calls,
            response_format,
            user,
            extra_body,
            deadline_s,
        )
        # The request holds them now: this frame stays on the stack while the call is out, and
        # the collector walks every frame in flight (22 references a call less at c=1024).
        del messages, session_id, parent_call_id, cache_salt, cache_namespace, structured, stream
        del model, temperature, top_p, max_tokens, stop, seed, presence_penalty
        del frequency_penalty, tools, tool_choice, parallel_tool_calls, response_format, user
        del extra_body, deadline_s
        return await self._handler(request)

    def stream(
        self,
        messages: Sequence[Message],
        *,
        structured: StructuredArg[ModelT] = None,
        restart_on_cut: bool = False,
        **options: Unpack[ChatOptions],
    ) -> ChatStream[ModelT]:
        """The same governed call as ``chat`` (same keywords, always streamed), its deltas
        yielded as they arrive::

            async with client.stream(messages, temperature=0.2) as stream:
                async for delta in stream:  # StreamDelta: content, thinking, tool_call
                    print(delta.text, end="")
            response = stream.response  # typed after structured=, as chat()'s result

        Before the first delta a failure retries / switches sources as ``chat`` does; after
        it a cut ends the stream with ``TransientError``, unless ``restart_on_cut=True``
        (then a ``"restart"`` delta marks that the next attempt starts from scratch). A
        cached answer arrives as one delta. Leaving the block early cancels the call and
        releases its permit, probe and connection.
        :raises RequestRejectedError: as ``chat``, at once (before any network).
        """
        handler = self._handler

        async def start(context: CallContext) -> LLMResponse[ModelT]:
            return await handler(request)  # built with the stream's context already

        chat_stream: ChatStream[ModelT] = ChatStream(start, restart_on_cut=restart_on_cut)
        request = self._request(
            messages, structured=structured, stream=True, context=chat_stream.context, **options
        )
        return chat_stream

    def _request(
        self,
        messages: Sequence[Message],
        session_id: str | None = None,
        parent_call_id: str | None = None,
        cache_salt: str | None = None,
        cache_namespace: str | None = None,
        structured: StructuredSpec = None,
        stream: bool = True,
        model: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: Mapping[str, Any] | None = None,
        user: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        context: CallContext | None = None,
    ) -> ChatRequest:
        """The validated request of one call (shared by ``chat`` and ``stream``). Its
        parameters are ``chat``'s, in ``chat``'s order (``chat`` passes them by position)."""
        if self._closed:
            raise ClientClosedError(f"this GatewayClient ({self._settings.scope}) is closed")
        check_message_shape(messages)
        if (
            model is None
            and temperature is None
            and top_p is None
            and max_tokens is None
            and stop is None
            and seed is None
            and presence_penalty is None
            and frequency_penalty is None
            and tools is None
            and tool_choice is None
            and parallel_tool_calls is None
            and response_format is None
            and user is None
            and extra_body is None
        ):
            # The usual call sets none: what building them and ``is_empty`` would say, without
            # the 14-field object (tests/client: test_unset_params_make_no_params).
            params: ChatParams | None = None
        else:
            params = call_params(
                model=model,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                stop=stop,
                seed=seed,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                response_format=response_format,
                user=user,
                extra_body=extra_body,
            )
        if structured is not None and structured != "json" and not _is_model_class(structured):
            raise StructuredSpecError(
                "structured must be None, 'json' or a pydantic BaseModel subclass, got "
                f"{structured!r} ({type(structured).__name__})"
            )
        if structured is not None and not self._structured_on:
            raise RequestRejectedError(
                "structured output was requested but this client's middleware has no "
                f"'structured' layer (middleware: {list(self._settings.middleware)})"
            )
        # The first seven by position (ChatRequest's order): every call builds one.
        request = ChatRequest(
            messages,
            session_id,
            parent_call_id,
            cache_salt,
            cache_namespace,
            structured,
            stream,
            params=params,
            deadline_s=deadline_s,
            context=context if context is not None else CallContext(),
        )
        return request

    # ------------------------------------------------------------------ parts and lifecycle

    @property
    def settings(self) -> ScopeSettings:
        return self._settings

    @property
    def governor(self) -> Governor:
        """The scope's governor (cooldown memo, in-flight counts, health probes; read it)."""
        return self._governor

    @property
    def components(self) -> Components:
        """The assembled parts (read-only)."""
        return self._components

    @property
    def limiter(self) -> RateLimiter:
        """Pass it to another client to share its gates (global concurrency, RPM, TPM)."""
        return self._components.limiter

    @property
    def breaker(self) -> ProviderGate:
        return self._components.breaker

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """Close what this client built and flush telemetry. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # The recorder last, once nothing can produce rows any more; an injected one is
        # flushed only.
        await close_client_parts(
            owned=self._owned,
            drains=self._drains,
            telemetry=self._components.telemetry,
            owns_telemetry=self._owns_telemetry,
        )

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        names = [s.name for s in self._settings.sources]
        state = "closed" if self._closed else "open"
        return f"<GatewayClient scope={self._settings.scope!r} sources={names} {state}>"


# --------------------------------------------------------------------------- gather_bounded


def _is_model_class(value: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(value, type) and issubclass(value, BaseModel)


@overload
async def gather_bounded(
    calls: Iterable[Callable[[], Awaitable[T]] | Awaitable[T]],
    concurrency: int,
    *,
    return_exceptions: Literal[False] = False,
) -> list[T]: ...


@overload
async def gather_bounded(
    calls: Iterable[Callable[[], Awaitable[T]] | Awaitable[T]],
    concurrency: int,
    *,
    return_exceptions: Literal[True],
) -> list[T | Exception]: ...


async def gather_bounded(
    calls: Iterable[Callable[[], Awaitable[T]] | Awaitable[T]],
    concurrency: int,
    *,
    return_exceptions: bool = False,
) -> list[T] | list[T | Exception]:
    """Run ``calls`` with at most ``concurrency`` in flight; results in input order.

    Each item is a zero-argument coroutine function (started only when a slot is free) or an
    awaitable. The first exception cancels everything still running, closes what never
    started, and is raised as itself (not wrapped in a group). With ``return_exceptions=True``
    (as ``asyncio.gather``) a failed item's exception takes its place in the results and the
    others keep going; cancellation still cancels everything.
    """
    if type(concurrency) is not int or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    items: list[Any] = list(calls)
    results: list[Any] = [None] * len(items)
    position = 0

    async def worker() -> None:
        nonlocal position
        while position < len(items):
            index = position
            position += 1
            item = items[index]
            items[index] = None  # started: nothing left to close for it
            if not return_exceptions:
                awaitable = item if inspect.isawaitable(item) else item()
                results[index] = await awaitable
                continue
            try:
                awaitable = item if inspect.isawaitable(item) else item()
                results[index] = await awaitable
            except Exception as exc:  # noqa: BLE001 - returned in place, as asked
                results[index] = exc

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(items))):
                group.create_task(worker())
    except ExceptionGroup as failure:
        first = failure.exceptions[0]
        for other in failure.exceptions[1:]:
            first.add_note(f"also failed meanwhile: {type(other).__name__}: {other}")
        raise first from None
    finally:
        for item in items:
            _discard(item)
    return results


def _discard(item: Any) -> None:
    """Dispose of a call that never ran: close a coroutine, cancel a future."""
    if item is None:
        return
    if inspect.iscoroutine(item):
        item.close()
    elif isinstance(item, asyncio.Future):
        item.cancel()


def call_params(
    *,
    model: str | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    seed: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    response_format: Mapping[str, Any] | None = None,
    user: str | None = None,
    extra_body: Mapping[str, Any] | None = None,
) -> ChatParams | None:
    """A call's generation parameters, checked (``RequestRejectedError`` naming the field);
    ``None`` when none is set."""
    params = ChatParams(
        model=model,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stop=stop if stop is None or isinstance(stop, str) else tuple(stop),
        seed=seed,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        tools=None if tools is None else tuple(tools),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        response_format=response_format,
        user=user,
        extra_body=extra_body,
    )
    if params.is_empty():
        return None
    check_params(params)
    return params
