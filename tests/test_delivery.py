"""The delivery room: one failure classifier, one backoff, one drain, one exit order.

Fed the exceptions the clients really raise (botocore's ``ClientError`` and its connection
errors, requests' ``HTTPError`` and ``ConnectionError``, the OS's), wrapped the way s3fs wraps
them; the waits run on real events and threads. No server, no mock.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from accelkit.checkpointing.storage import retry as storage_retry
from accelkit.delivery import (
    HARD,
    REFUSED,
    TRANSIENT,
    Backoff,
    Deadline,
    ReportOnce,
    RetryPolicy,
    classify,
    drain,
    error_code,
)
from accelkit.trackers.delivery import failures as tracker_failures

REPO = Path(__file__).resolve().parents[1]


def _client_error(code: str, status: int) -> Exception:
    botocore = pytest.importorskip("botocore.exceptions", reason="needs botocore")
    response: Any = {"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {}}
    response["ResponseMetadata"]["HTTPStatusCode"] = status
    return botocore.ClientError(response, "GetObject")


def _http_error(status: int) -> Exception:
    requests = pytest.importorskip("requests", reason="needs requests")
    response = requests.Response()
    response.status_code = status
    return requests.HTTPError(f"{status} from the server", response=response)


def _wrapped(error: Exception, wrapper: Exception) -> Exception:
    try:
        try:
            raise error
        except Exception as exc:
            raise wrapper from exc
    except Exception as outer:
        return outer


class _CodedError(Exception):
    """An error carrying a service's ``error_code`` string, as MLflow's ``MlflowException``."""

    def __init__(self, code: str) -> None:
        super().__init__("the service said no")
        self.error_code = code


def test_s3_answers_are_read_by_code_and_status() -> None:
    assert classify(_client_error("SlowDown", 503)) == TRANSIENT
    assert classify(_client_error("InvalidAccessKeyId", 403)) == HARD
    assert classify(_client_error("NoSuchBucket", 404)) == HARD
    # a missing key is S3's ordinary answer, not a failure of the service
    assert classify(_client_error("NoSuchKey", 404)) is None
    wrapped = _wrapped(_client_error("NoSuchBucket", 404), OSError(5, "s3fs"))
    assert classify(wrapped) == HARD and error_code(wrapped) == "NoSuchBucket"
    assert classify(wrapped, chain=False) is None  # the wrapper alone says nothing


def test_http_and_service_codes_are_read_the_same_way_for_every_client() -> None:
    assert classify(_http_error(401)) == HARD
    assert classify(_http_error(404)) == HARD  # no run, experiment or endpoint there
    assert classify(_http_error(429)) == TRANSIENT
    assert classify(_http_error(502)) == TRANSIENT
    assert classify(_CodedError("RESOURCE_DOES_NOT_EXIST")) == HARD
    assert classify(_CodedError("INVALID_PARAMETER_VALUE")) == REFUSED
    assert classify(_CodedError("SOMETHING_ELSE")) is None
    requests = pytest.importorskip("requests")
    assert classify(requests.ConnectionError("refused")) == TRANSIENT
    botocore = pytest.importorskip("botocore.exceptions")
    assert classify(botocore.EndpointConnectionError(endpoint_url="http://127.0.0.1:1")) == (
        TRANSIENT
    )
    assert classify(botocore.NoCredentialsError()) == HARD


def test_the_message_text_is_never_read() -> None:
    assert classify(RuntimeError("503 SlowDown: connection refused, AccessDenied")) is None
    assert classify(ConnectionResetError(104, "AccessDenied")) == TRANSIENT


def test_builtin_types_are_a_clients_answer_only_when_asked() -> None:
    for error, as_client in [
        (ValueError("not a number"), REFUSED),
        (TypeError("not a float"), REFUSED),
        (KeyError("name"), REFUSED),
        (PermissionError(13, "read-only"), HARD),
        (FileNotFoundError(2, "missing"), None),
        (TimeoutError("slow"), TRANSIENT),
    ]:
        assert classify(error, builtin_types=True) == as_client, error
        storage = TRANSIENT if as_client == TRANSIENT else None
        assert storage_retry.classify(error) == storage, error  # storage: a bug, a missing file
    # trackers read the error itself: a handled 404 left on __context__ does not make a later
    # connection error hard
    late = _wrapped(_http_error(404), ConnectionRefusedError(111, "refused"))
    assert classify(late) == HARD
    assert tracker_failures.classify(late) == TRANSIENT


def test_one_schedule_with_and_without_jitter() -> None:
    plain = RetryPolicy(base_delay=0.5, max_delay=4.0, jitter=0.0, deadline=None)
    assert [plain.delay(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    jittered = RetryPolicy(base_delay=1.0, max_delay=8.0, jitter=0.5)
    rng = random.Random(1)
    assert all(0.5 <= jittered.delay(0, rng) <= 1.0 for _ in range(100))
    with pytest.raises(ValueError, match="multiplier"):
        RetryPolicy(multiplier=0.5)


def test_backoff_follows_the_policy_asked_at_each_failure_and_starts_over() -> None:
    longest = [2.0]
    asked: list[float] = []

    def policy() -> RetryPolicy:
        asked.append(longest[0])
        return RetryPolicy(base_delay=0.5, max_delay=longest[0], jitter=0.0, deadline=None)

    backoff = Backoff(policy)
    waits = []
    for _ in range(4):
        before = time.monotonic()
        first = backoff.failed()
        waits.append((first, round(backoff.retry_at - before, 1)))
    assert waits == [(True, 0.5), (False, 1.0), (False, 2.0), (False, 2.0)]
    longest[0] = 8.0
    backoff.failed()
    assert len(asked) == 5 and backoff.retry_at - time.monotonic() > 7.0
    lasted = backoff.answered()
    assert lasted is not None and lasted >= 0 and backoff.outage is None
    assert backoff.retry_at == 0.0
    backoff.failed()
    assert backoff.retry_at - time.monotonic() <= 0.5


def test_the_trackers_backoff_reads_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "0.2")
    policy = tracker_failures.retry_policy()
    assert [policy.delay(n) for n in range(3)] == [0.2, 0.2, 0.2]
    monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "-3")
    with pytest.raises(ValueError, match="ACCELKIT_TRACKER_RETRY_MAX_S"):
        tracker_failures.retry_policy()


def test_a_deadline_bounds_every_wait() -> None:
    endless = Deadline(None)
    assert endless.left() is None and not endless.expired() and endless.within(0.5) == 0.5
    short = Deadline(0.05)
    assert 0 < (short.left() or 0) <= 0.05 and short.within(10.0) <= 0.05
    time.sleep(0.06)
    assert short.expired() and short.left() == 0.0
    assert Deadline(-1).expired()


def test_drain_returns_when_done_or_when_time_is_up() -> None:
    event = threading.Event()
    done = threading.Event()
    threading.Timer(0.05, done.set).start()
    began = time.monotonic()
    assert drain(done.is_set, Deadline(5.0), event.wait, poll=0.01)
    assert time.monotonic() - began < 2.0
    began = time.monotonic()
    assert not drain(lambda: False, Deadline(0.1), event.wait, poll=0.02)
    assert 0.09 <= time.monotonic() - began < 1.0


def test_report_once_across_threads() -> None:
    said = ReportOnce()
    firsts: list[bool] = []
    lock = threading.Lock()

    def report() -> None:
        first = said.first(("tracker", "ValueError"))
        with lock:
            firsts.append(first)

    threads = [threading.Thread(target=report) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert firsts.count(True) == 1 and len(firsts) == 8
    assert said.first(("tracker", "TypeError"))


# ---------------------------------------------------------------- the exit drains, in order

_EXIT_ORDER = textwrap.dedent(
    """
    import concurrent.futures, sys
    from accelkit.delivery.exit import REPLICATION, SAVES, TRACKERS, at_exit

    def say(what):
        return lambda: print(what, flush=True)

    def fail():
        raise RuntimeError("a drain that fails")

    def save_commits():  # a save committing at exit starts the remote tier's drain
        print("saves", flush=True)
        at_exit(say("replication, registered during the exit"), REPLICATION)

    at_exit(say("trackers"), TRACKERS)
    at_exit(fail, REPLICATION, "the failing drain")
    at_exit(say("replication"), REPLICATION)
    at_exit(say("cancelled"), SAVES).cancel()
    at_exit(save_commits, SAVES)
    # a pool created after the registrations still takes work in the drains (move_last)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    at_exit(lambda: print(pool.submit(lambda: "a pool still works").result(), flush=True),
            TRACKERS)
    """
)


def test_exit_drains_run_in_phase_order_whoever_registered_first(tmp_path: Path) -> None:
    # Saves in flight commit first (their checkpoints are queued for replication), then the
    # replication queue drains, then the trackers report both: in a real interpreter exit.
    script = tmp_path / "exits.py"
    script.write_text(_EXIT_ORDER)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "saves",
        "replication",
        "replication, registered during the exit",
        "trackers",
        "a pool still works",
    ]
    assert "At exit, the failing drain failed" in done.stderr
    assert "RuntimeError: a drain that fails" in done.stderr


def test_an_exit_drain_needs_a_known_phase() -> None:
    from accelkit.delivery.exit import at_exit

    with pytest.raises(ValueError, match=r"phase=7: expected SAVES, REPLICATION or TRACKERS"):
        at_exit(lambda: None, 7)
