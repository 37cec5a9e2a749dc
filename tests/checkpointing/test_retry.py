"""Retries of transient storage errors: the classifier, the backoff, a direct remote save.

The classifier is fed the exceptions botocore and the OS really raise (botocore's own classes,
wrapped the way s3fs wraps them); the direct save runs against SeaweedFS behind a TCP proxy
that is down when the save starts.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.catalog.listing import list_checkpoints
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.storage import get_storage, join
from accelkit.checkpointing.storage.retry import (
    HARD,
    TRANSIENT,
    RetryPolicy,
    classify,
    hard_error_fix,
    retry_call,
)
from tests.fixtures.s3 import S3Server
from tests.helpers.faultproxy import FaultProxy

botocore = pytest.importorskip("botocore.exceptions", reason="needs botocore (pip install s3fs)")


def _client_error(code: str, status: int) -> Exception:
    response: Any = {"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {}}
    response["ResponseMetadata"]["HTTPStatusCode"] = status
    return botocore.ClientError(response, "PutObject")


def _as_s3fs(error: Exception) -> OSError:
    """Wrapped as s3fs re-raises botocore's errors: an OSError caused by it."""
    try:
        try:
            raise error
        except Exception as exc:
            raise OSError(5, "s3fs: request failed") from exc
    except OSError as wrapped:
        return wrapped


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ConnectionRefusedError(111, "refused"), TRANSIENT),
        (ConnectionResetError(104, "reset"), TRANSIENT),
        (TimeoutError("timed out"), TRANSIENT),
        (_client_error("SlowDown", 503), TRANSIENT),
        (_client_error("InternalError", 500), TRANSIENT),
        (_client_error("TooManyRequests", 429), TRANSIENT),
        (_as_s3fs(_client_error("ServiceUnavailable", 503)), TRANSIENT),
        (botocore.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), TRANSIENT),
        (botocore.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), TRANSIENT),
        (_client_error("AccessDenied", 403), HARD),
        (_as_s3fs(_client_error("NoSuchBucket", 404)), HARD),
        (_client_error("InvalidAccessKeyId", 403), HARD),
        (botocore.NoCredentialsError(), HARD),
        (FileNotFoundError("no such key"), None),
        (ValueError("a bug"), None),
    ],
)
def test_classify_real_errors(error: BaseException, kind: str | None) -> None:
    assert classify(error) == kind


def test_hard_errors_name_their_fix() -> None:
    assert "create the bucket" in hard_error_fix(_as_s3fs(_client_error("NoSuchBucket", 404)))
    assert "grant" in hard_error_fix(_client_error("AccessDenied", 403))
    assert "secret" in hard_error_fix(_client_error("SignatureDoesNotMatch", 403))


def test_backoff_grows_is_capped_and_jittered() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=8.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(0)
    waits = [[policy.delay(n, rng) for _ in range(200)] for n in range(6)]
    for n, samples in enumerate(waits):
        raw = min(8.0, 2.0**n)
        assert all(raw * 0.5 <= w <= raw for w in samples)
        assert len({round(w, 6) for w in samples}) > 100  # jittered, not one value
    assert max(waits[5]) <= 8.0
    with pytest.raises(ValueError, match="jitter"):
        RetryPolicy(jitter=2)


def test_retry_call_retries_transient_only() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionResetError(104, "reset")
        return "ok"

    waits: list[float] = []
    fast = RetryPolicy(base_delay=0.01, max_delay=0.02, deadline=None)
    assert retry_call(flaky, fast, "flaky", sleep=waits.append) == "ok"
    assert len(calls) == 4 and len(waits) == 3

    hard: list[int] = []

    def denied() -> None:
        hard.append(1)
        raise _client_error("AccessDenied", 403)

    with pytest.raises(botocore.ClientError):
        retry_call(denied, fast, "denied", sleep=waits.append)
    assert len(hard) == 1  # never retried

    def down() -> None:
        raise ConnectionRefusedError(111, "refused")

    start = time.monotonic()
    with pytest.raises(ConnectionRefusedError) as info:
        retry_call(down, RetryPolicy(base_delay=0.05, max_delay=0.1, deadline=0.5), "down")
    assert 0.3 < time.monotonic() - start < 2.0
    assert "retried down" in "".join(getattr(info.value, "__notes__", []))


def _accelerator(project: str, options: dict[str, Any], **config: Any) -> tuple[Accelerator, Any]:
    cfg = ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, storage_options=options, **config
    )
    accelerator = Accelerator(project_config=cfg, cpu=True)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    accelerator.prepare(model)
    return accelerator, model


def _proxied(server: S3Server, proxy: FaultProxy) -> dict[str, Any]:
    return {
        **server.storage_options,
        "endpoint_url": proxy.endpoint_url,
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5},
    }


@pytest.mark.slow
def test_direct_remote_save_survives_an_outage(s3_server: S3Server) -> None:
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        options = _proxied(s3_server, proxy)
        project = s3_server.new_prefix()
        accelerator, _ = _accelerator(project, options)
        accelerator.save_state()
        proxy.down_for(2.5)  # the next save starts in a full outage
        start = time.monotonic()
        path = accelerator.save_state()
        assert time.monotonic() - start >= 2.0  # it waited the outage out, then committed
        assert proxy.dropped > 0
        root = join(project, "checkpoints")
        states = {
            i.name: i.state
            for i in list_checkpoints(get_storage(root, s3_server.storage_options), root)
        }
        assert states == {"checkpoint_0": "committed", "checkpoint_1": "committed"}, states
        assert path.endswith("checkpoint_1")

        # storage_retry_seconds=0: the old behaviour, the save fails at once, nothing committed.
        quick, _ = _accelerator(project, options, storage_retry_seconds=0, iteration=2)
        proxy.down_for(30)
        with pytest.raises(CheckpointError):
            quick.save_state()
        proxy.up()


@pytest.mark.slow
def test_reset_mid_upload_is_retried_per_file(s3_server: S3Server) -> None:
    with FaultProxy(("127.0.0.1", s3_server.port), seed=3) as proxy:
        options = _proxied(s3_server, proxy)
        project = s3_server.new_prefix()
        accelerator, model = _accelerator(project, options)
        blob = {"x": torch.randn(200_000)}

        class Blob:
            def state_dict(self) -> dict[str, torch.Tensor]:
                return blob

            def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
                blob.update(state)

        accelerator.register_for_checkpointing(Blob())
        # the next 3 connections are cut after 64 KB went upstream: uploads die mid-body
        proxy.reset_after_bytes, proxy.reset_next = 64 * 1024, 3
        proxy.cut_all()
        path = accelerator.save_state()
        proxy.reset_after_bytes = None
        assert proxy.cut > 0, "no upload was cut: the test proved nothing"
        fresh, fresh_model = _accelerator(project, {**s3_server.storage_options})
        fresh.register_for_checkpointing(Blob())
        before = blob["x"].clone()
        blob["x"] = torch.zeros(200_000)
        assert fresh.load_state() == path
        assert torch.equal(blob["x"], before)
        for a, b in zip(model.parameters(), fresh_model.parameters()):
            assert torch.equal(a, b)
