"""The soak fleet: the fault-injecting sources of the fake upstream and the client
configuration that points the governed clients at them (one table, so the scoreboard knows
what each source was meant to do and which limits it had).

| fake source | scope | client source | fault | limits |
|---|---|---|---|---|
| llm-healthy-1, -2 | LLM | openai-1, -2 | none | concurrency 32 |
| llm-bad-key | LLM | openai-3 | 401 invalid_api_key (dead) | |
| llm-black-hole | LLM | openai-4 | reads the request, never answers | |
| llm-slow | LLM | openai-5 | a token every 0.6 s (inter-token watchdog 0.4 s) | |
| llm-tight | LLM | openai-6 | none | concurrency 2, RPM 30, TPM 12000 |
| llm-flaky | LLM | openai-7 | 429 Retry-After 1 / 503 / reset among answers | |
| llm-truncated | LLM | openai-8 | streams cut before the end (2 in 3) | |
| emb-healthy | EMBED | generic-1 | none | |
| emb-flaky | EMBED | generic-2 | 429 Retry-After 1 / 503 | |
| emb-bad-key | EMBED | generic-3 | 401 (dead) | |
| ocr-a, ocr-b (fake MonkeyOCR) | OCR | monkey-1, -2 | ocr-b serialises | ocr-b concurrency 1 |

Global gates per scope (the soak budget): concurrency 100, RPM 600 (``--global-rpm`` changes it; 0
turns it off for throughput runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHAT_MODEL = "soak-chat"
EMBED_MODEL = "soak-embed"
PRICES = {
    "currency": "USD",
    CHAT_MODEL: {"input_per_1m": 1.0, "output_per_1m": 2.0},
    EMBED_MODEL: {"input_per_1m": 0.1, "output_per_1m": 0.0},
    "monkeyocr": {"input_per_1m": 0.0, "output_per_1m": 0.0},
}

COOLDOWN_S = 10.0
FAIL_THRESHOLD = 3
TIMEOUT_S = 5.0
TTFT_TIMEOUT_S = 1.5
INTER_TOKEN_TIMEOUT_S = 0.4
CALL_DEADLINE_S = 20.0
GLOBAL_CONCURRENCY = 100
GLOBAL_RPM = 600

_HEALTHY = {"ok": {"structured": True, "reasoning": "Let me think about it.", "chunks": 8}}


@dataclass(frozen=True)
class Source:
    fake: str
    scope: str
    client: str
    fault: str
    """healthy | dead | black_hole | slow | tight | flaky | truncated"""
    behaviour: dict[str, Any]
    max_concurrency: int = 0
    rpm: int = 0
    tpm: int = 0


FLEET: tuple[Source, ...] = (
    Source("llm-healthy-1", "LLM", "openai-1", "healthy", {"reply": _HEALTHY}, 32),
    Source("llm-healthy-2", "LLM", "openai-2", "healthy", {"reply": _HEALTHY}, 32),
    Source("llm-bad-key", "LLM", "openai-3", "dead", {"reply": {"error": {"status": 401}}}),
    Source("llm-black-hole", "LLM", "openai-4", "black_hole", {"reply": {"black_hole": {}}}),
    Source(
        "llm-slow",
        "LLM",
        "openai-5",
        "slow",
        {"reply": {"ok": {"structured": True, "chunks": 6, "inter_token_delay": 0.6}}},
    ),
    Source("llm-tight", "LLM", "openai-6", "tight", {"reply": _HEALTHY}, 2, 30, 12000),
    Source(
        "llm-flaky",
        "LLM",
        "openai-7",
        "flaky",
        {
            "mix": [
                [6, _HEALTHY],
                [2, {"error": {"status": 429, "retry_after": 1}}],
                [1, {"error": {"status": 503}}],
                [1, {"reset": {}}],
            ],
            "seed": 7,
        },
    ),
    Source(
        "llm-truncated",
        "LLM",
        "openai-8",
        "truncated",
        {"mix": [[1, _HEALTHY], [2, {"cut": {"after_chunks": 2}}]], "seed": 11},
    ),
    Source(
        "emb-healthy", "EMBED", "generic-1", "healthy", {"route": "embeddings", "reply": {"ok": {}}}
    ),
    Source(
        "emb-flaky",
        "EMBED",
        "generic-2",
        "flaky",
        {
            "route": "embeddings",
            "mix": [
                [7, {"ok": {}}],
                [2, {"error": {"status": 429, "retry_after": 1}}],
                [1, {"error": {"status": 503}}],
            ],
            "seed": 5,
        },
    ),
    Source(
        "emb-bad-key",
        "EMBED",
        "generic-3",
        "dead",
        {"route": "embeddings", "reply": {"error": {"status": 401}}},
    ),
)
OCR_SOURCES: tuple[Source, ...] = (
    Source("ocr-a", "OCR", "monkey-1", "healthy", {}),
    Source("ocr-b", "OCR", "monkey-2", "healthy", {"serial": True}, 1),
)


def sources_file() -> dict[str, Any]:
    """The fake upstream's ``--sources`` JSON."""
    return {s.fake: s.behaviour for s in FLEET}


def source_table() -> list[dict[str, Any]]:
    """Every source with its scope, client name, fault and limits (for run.json)."""
    return [
        {
            "fake": s.fake,
            "scope": s.scope,
            "client": s.client,
            "fault": s.fault,
            "max_concurrency": s.max_concurrency,
            "rpm": s.rpm,
            "tpm": s.tpm,
        }
        for s in (*FLEET, *OCR_SOURCES)
    ]


def client_env(
    *,
    upstream: str,
    ocr_upstream: str,
    redis_url: str,
    telemetry: dict[str, str],
    pricing_path: str,
    run_id: str,
    global_rpm: int = GLOBAL_RPM,
    global_concurrency: int = GLOBAL_CONCURRENCY,
    cache: bool = True,
    healthy_only: bool = False,
) -> dict[str, str]:
    """The environment of every worker's clients (scopes LLM, EMBED, OCR); ``healthy_only``
    configures only the healthy sources (throughput runs)."""
    env: dict[str, str] = {
        "PGW_PLUGINS": "redis,postgres,embedding,monkeyocr",
        "PGW_LIMITER_BACKEND": "redis",
        "PGW_BREAKER_BACKEND": "redis",
        "PGW_CACHE_BACKEND": "redis" if cache else "none",
        "REDIS_URL": redis_url,
        "PGW_CACHE_NAMESPACE": run_id,
        "PGW_CACHE_TTL_S": "3600",
        "PGW_PRICING_PATH": pricing_path,
        "PGW_QUOTA_FULL": "wait",
        **telemetry,
    }
    for scope in ("LLM", "EMBED", "OCR"):
        env |= {
            f"{scope}__GLOBAL__MAX_CONCURRENCY": str(global_concurrency),
            f"{scope}__GLOBAL__RPM": str(global_rpm),
            f"{scope}__BREAKER__FAIL_THRESHOLD": str(FAIL_THRESHOLD),
            f"{scope}__BREAKER__COOLDOWN_S": str(COOLDOWN_S),
            f"{scope}__RETRY__MAX_ATTEMPTS": "4",
            f"{scope}__RETRY__CALL_DEADLINE_S": str(CALL_DEADLINE_S),
            f"{scope}__RETRY__BASE_DELAY_S": "0.1",
            f"{scope}__RETRY__MAX_DELAY_S": "1",
        }
    env["EMBED__BATCH_SIZE"] = "16"
    env["LLM__STRUCTURED__STRATEGY"] = "auto"  # native JSON-schema output where supported
    for s in FLEET:
        if healthy_only and s.fault != "healthy":
            continue
        n = s.client.rsplit("-", 1)[1]
        # The openai profile asks for native JSON-schema output (the structured scenarios).
        provider = "OPENAI" if s.scope == "LLM" else "GENERIC"
        prefix = f"{s.scope}__{provider}__{n}__"
        env |= {
            prefix + "BASE_URL": f"{upstream}/{s.fake}/v1",
            prefix + "API_KEY": f"sk-soak-{s.fake}",
            prefix + "MODEL": CHAT_MODEL if s.scope == "LLM" else EMBED_MODEL,
            prefix + "TIMEOUT_S": str(TIMEOUT_S),
        }
        if s.scope == "LLM":
            env |= {
                prefix + "TTFT_TIMEOUT_S": str(TTFT_TIMEOUT_S),
                prefix + "INTER_TOKEN_TIMEOUT_S": str(INTER_TOKEN_TIMEOUT_S),
            }
        if s.max_concurrency:
            env[prefix + "MAX_CONCURRENCY"] = str(s.max_concurrency)
        if s.rpm:
            env[prefix + "RPM"] = str(s.rpm)
        if s.tpm:
            env[prefix + "TPM"] = str(s.tpm)
    for s in OCR_SOURCES:
        n = s.client.rsplit("-", 1)[1]
        prefix = f"OCR__MONKEY__{n}__"
        env[prefix + "BASE_URL"] = f"{ocr_upstream}/{s.fake}"
        env[prefix + "TIMEOUT_S"] = "10"
        if s.max_concurrency:
            env[prefix + "MAX_CONCURRENCY"] = str(s.max_concurrency)
    return env
