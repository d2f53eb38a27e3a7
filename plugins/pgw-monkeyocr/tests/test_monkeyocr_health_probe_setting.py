"""``OCR__BREAKER__HEALTH_PROBE``: an OCR scope has no cheap request to probe a source with
(every request runs the model), so turning the background probe on is a ``ConfigError``
naming the key and why, whether it comes from the environment, the pipeline file or
hand-built settings; off (or unset) is fine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pgw_monkeyocr import OcrClient
from pgw_monkeyocr.testing import FakeMonkeyOcr
from polygateway.errors import ConfigError

WHY = "no cheap request to probe a source with"


def _env(fake: FakeMonkeyOcr, **extra: str) -> dict[str, str]:
    return {
        "OCR__MONKEY__1__BASE_URL": fake.base_url("a"),
        "PGW_TELEMETRY_BACKEND": "none",
        **extra,
    }


def test_on_in_the_environment_is_refused_naming_the_key(fake_monkeyocr: FakeMonkeyOcr) -> None:
    env = _env(fake_monkeyocr, OCR__BREAKER__HEALTH_PROBE="true")
    with pytest.raises(ConfigError, match="OCR__BREAKER__HEALTH_PROBE") as caught:
        OcrClient.from_env(env=env, pipeline_path=None)
    assert WHY in str(caught.value)
    assert "every OCR request runs the model" in str(caught.value)


def test_on_in_the_pipeline_file_is_refused_naming_its_key(
    fake_monkeyocr: FakeMonkeyOcr, tmp_path: Path
) -> None:
    pipeline = tmp_path / "pgw.toml"
    pipeline.write_text("[scopes.OCR.breaker]\nhealth_probe = true\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"health_probe") as caught:
        OcrClient.from_env(env=_env(fake_monkeyocr), pipeline_path=pipeline)
    assert WHY in str(caught.value)
    assert "scopes.OCR.breaker" in str(caught.value)


async def test_on_in_hand_built_settings_is_refused(fake_monkeyocr: FakeMonkeyOcr) -> None:
    async with OcrClient.from_env(env=_env(fake_monkeyocr), pipeline_path=None) as client:
        settings = client.settings
    probing = dataclasses.replace(
        settings, breaker=dataclasses.replace(settings.breaker, health_probe=True)
    )
    with pytest.raises(ConfigError, match="OCR__BREAKER__HEALTH_PROBE") as caught:
        OcrClient(probing)
    assert WHY in str(caught.value)


@pytest.mark.parametrize("value", ["false", None])
async def test_off_or_unset_is_fine(fake_monkeyocr: FakeMonkeyOcr, value: str | None) -> None:
    extra = {} if value is None else {"OCR__BREAKER__HEALTH_PROBE": value}
    async with OcrClient.from_env(env=_env(fake_monkeyocr, **extra), pipeline_path=None) as client:
        assert client.settings.breaker.health_probe is False
