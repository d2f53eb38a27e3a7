"""The configuration loader: env + ``.env`` + the TOML pipeline file -> ``GatewaySettings``.

The only place in the library that reads the environment. Typical use::

    from polygateway.config import load_scope
    settings = load_scope("LLM")                 # os.environ over ./.env, ./pgw.toml if present

Every problem becomes one line of ``ConfigError.problems`` naming the key (``LLM__QWEN__1__
TIMEOUT_S`` or ``pgw.toml:[scopes.LLM.retry].max_attempts``), the rejected value unless it may be
a secret, and the allowed values or registered names. Key families, precedence and the file
format are documented in ``env.py``, ``merge.py`` and ``pgw.example.toml``; components' options
(declared by whoever registers the component) in ``components.py`` and ``polygateway.options``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polygateway.config.env import read_env
from polygateway.config.guards import (
    NameRegistry,
    check_guards,
    middleware_problems,
    validate_against_registry,
)
from polygateway.config.inputs import plugin_filter
from polygateway.config.kinds import CHAT_CALLS, CallKind
from polygateway.config.loader import load_scope, load_settings

if TYPE_CHECKING:
    from polygateway.config.describe import describe_settings


def __getattr__(name: str) -> Any:
    # ``pgw config check`` is its only user: loading settings does not import it.
    if name == "describe_settings":
        from polygateway.config.describe import describe_settings

        return describe_settings
    raise AttributeError(f"module 'polygateway.config' has no attribute {name!r}")


__all__ = [
    "CHAT_CALLS",
    "CallKind",
    "NameRegistry",
    "check_guards",
    "describe_settings",
    "load_scope",
    "load_settings",
    "middleware_problems",
    "plugin_filter",
    "read_env",
    "validate_against_registry",
]
