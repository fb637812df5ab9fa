"""The tests' own services are named apart from the product's settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.services import kafka_service, redis_service


def test_no_product_setting_of_the_shell_reaches_the_tests() -> None:
    kept = ("TOKENFLEET_TEST_", "TOKENFLEET_CACHE", "TOKENFLEET_TRACES", "TOKENFLEET_CALIBRATION")
    assert [name for name in os.environ if name.startswith("TOKENFLEET_")] == [
        name for name in os.environ if name.startswith(kept)
    ]


def test_the_tests_services_come_from_their_own_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", "production:9092")  # set after the scrub
    monkeypatch.setenv("TOKENFLEET_REDIS_URL", "redis://production:6379/0")
    monkeypatch.setenv("TOKENFLEET_TEST_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
    monkeypatch.setenv("TOKENFLEET_TEST_REDIS_URL", "redis://127.0.0.1:16379/0")
    with kafka_service(tmp_path) as kafka, redis_service(tmp_path) as redis:
        assert (kafka.address, kafka.origin) == (
            "127.0.0.1:19092",
            "TOKENFLEET_TEST_KAFKA_BOOTSTRAP",
        )
        assert (redis.address, redis.origin) == (
            "redis://127.0.0.1:16379/0",
            "TOKENFLEET_TEST_REDIS_URL",
        )
