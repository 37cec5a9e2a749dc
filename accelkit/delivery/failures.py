"""One classification of delivery failures: transient, hard or refused.

Checkpoint storage (an object store), replication and the trackers' backends all call somebody
else's network service. What retrying can do about a failure is decided here, once, from the
exception's classes and the codes and HTTP statuses it carries, never from its message text:

- :data:`TRANSIENT` -- the network or the server failed this time (a refused or reset
  connection, a timeout, HTTP 429 or 5xx, ``SlowDown``): the same request succeeds later, so
  it is retried with backoff.
- :data:`HARD` -- retrying cannot help anything sent there (wrong or missing credentials, HTTP
  401/403, a missing bucket, MLflow's ``UNAUTHENTICATED``/``RESOURCE_DOES_NOT_EXIST``, an HTTP
  404 other than S3's, whose code says what is missing): it is reported with its fix and
  that destination is given up.
- :data:`REFUSED` -- the service refuses this one request's content (MLflow's
  ``INVALID_PARAMETER_VALUE``, ``BAD_REQUEST``): only that item is skipped.
- ``None`` -- not recognised (a missing file, a bug): each caller's own default applies
  (storage lets it rise; a tracker retries it).

Nothing here imports botocore, requests or urllib3: their errors are read by the names of the
exception's classes and by duck-typed attributes (botocore's ``response`` mapping, an
``error_code`` string, a ``status_code`` or ``response.status_code`` integer).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

__all__ = [
    "HARD",
    "HARD_CODES",
    "REFUSED",
    "TRANSIENT",
    "causes",
    "classify",
    "error_code",
    "service_answer",
]

TRANSIENT: Final = "transient"
HARD: Final = "hard"
REFUSED: Final = "refused"

# Exception classes (by name, from botocore, aiohttp, urllib3, requests, s3fs) that mean "the
# network or the server failed this time". Names, not imports: none is a dependency.
_TRANSIENT_CLASSES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ServerDisconnectedError",
        "ClientConnectorError",
        "ClientConnectionError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerTimeoutError",
        "ProtocolError",
        "ProxyConnectionError",
        "HTTPClientError",
        # requests' own (an OSError, not the built-in ConnectionError/TimeoutError)
        "ConnectionError",
        "Timeout",
    }
)
_HARD_CLASSES = frozenset(
    {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "InternalServerError",
        "BadGateway",
        "GatewayTimeout",
    }
)
HARD_CODES: Final[Mapping[str, str]] = {
    # S3's
    "InvalidAccessKeyId": "the access key is not known to the server",
    "SignatureDoesNotMatch": "the secret key does not match the access key",
    "ExpiredToken": "the session token has expired",
    "InvalidToken": "the session token is not valid",
    "AccessDenied": "the credentials may not do this",
    "AllAccessDisabled": "access to the bucket is disabled",
    "NoSuchBucket": "the bucket does not exist",
    "InvalidBucketName": "the bucket name is not valid",
    "AccountProblem": "the account has a problem",
    # MLflow's (gRPC-style names)
    "UNAUTHENTICATED": "the credentials are not accepted",
    "PERMISSION_DENIED": "the credentials may not do this",
    "RESOURCE_DOES_NOT_EXIST": "the experiment or run does not exist",
}
"""Error codes retrying cannot fix, each with what it means."""
# Error codes (MLflow's ``error_code``) that refuse one request's content.
_REFUSED_CODES = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE"})
_HARD_STATUS = frozenset({401, 403})
_MAX_CHAIN = 8


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, then its causes (``__cause__``, ``__context__``), breadth first, each once,
    at most 8 (a wrapper such as s3fs re-raises botocore's errors as ``OSError``)."""
    seen: set[int] = set()
    todo = [error]
    while todo and len(seen) < _MAX_CHAIN:
        one = todo.pop(0)
        if id(one) in seen:
            continue
        seen.add(id(one))
        yield one
        for nxt in (one.__cause__, one.__context__):
            if nxt is not None:
                todo.append(nxt)


def service_answer(error: BaseException) -> tuple[str, int | None] | None:
    """The service's error code and HTTP status that ``error`` itself carries (``("", None)``
    parts where it has one but not the other), or ``None`` if it carries neither.

    Read: botocore's ``ClientError.response`` (``Error.Code``, ``ResponseMetadata.
    HTTPStatusCode``), an ``error_code`` string (MLflow's ``MlflowException``), a
    ``status_code`` integer on the error or on its ``response`` (requests' ``HTTPError``).
    """
    code = ""
    status: object = None
    response = getattr(error, "response", None)
    if isinstance(response, Mapping):  # botocore's ClientError.response
        code = str((response.get("Error") or {}).get("Code", ""))
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    else:
        status = getattr(response, "status_code", None)
    own = getattr(error, "error_code", None)
    if not code and isinstance(own, str):
        code = own
    if not isinstance(status, int) or isinstance(status, bool):
        own_status = getattr(error, "status_code", None)
        status = own_status if isinstance(own_status, int) else None
    if not code and status is None:
        return None
    return code, status if isinstance(status, int) else None


def error_code(error: BaseException) -> str:
    """The first service error code (``"NoSuchUpload"``, ``"RESOURCE_DOES_NOT_EXIST"``, ...) on
    ``error``'s chain of causes, ``""`` if none."""
    for one in causes(error):
        answer = service_answer(one)
        if answer is not None and answer[0]:
            return answer[0]
    return ""


def _by_answer(code: str, status: int | None, s3: bool) -> str | None:
    if code in HARD_CODES:
        return HARD
    if code in _REFUSED_CODES:
        return REFUSED
    # S3's 404 is read by its code (NoSuchBucket is hard, a missing key is no failure);
    # elsewhere a 404 means the endpoint, experiment or run is not there.
    if status in _HARD_STATUS or (status == 404 and not s3):
        return HARD
    if code in _TRANSIENT_CODES or status == 429 or (status is not None and status >= 500):
        return TRANSIENT
    if code.isdigit() and (int(code) >= 500 or int(code) == 429):
        return TRANSIENT
    return None


def _one(error: BaseException, builtin_types: bool) -> str | None:
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & _HARD_CLASSES:
        return HARD
    answer = service_answer(error)
    if answer is not None:
        s3 = isinstance(getattr(error, "response", None), Mapping)
        kind = _by_answer(*answer, s3)
        if kind is not None:
            return kind
    if names & _TRANSIENT_CLASSES or isinstance(error, (ConnectionError, TimeoutError)):
        return TRANSIENT
    if builtin_types:
        if isinstance(error, PermissionError):
            return HARD
        if isinstance(error, OSError):
            return None  # a full disk that may be freed, a missing file
        if isinstance(error, (TypeError, ValueError, KeyError)):
            return REFUSED
    return None


def classify(
    error: BaseException, *, chain: bool = True, builtin_types: bool = False
) -> str | None:
    """Whether ``error`` is :data:`TRANSIENT`, :data:`HARD`, :data:`REFUSED` or ``None``
    (not recognised), from its classes, codes and HTTP status (see the module docstring).

    Args:
        error: the exception a call to the service raised.
        chain: read its causes too (``__cause__``, ``__context__``: s3fs re-raises botocore's
            errors as ``OSError``); a hard cause anywhere wins, else the first verdict found.
            A tracker reads the error alone: a client's handled errors stay on ``__context__``.
        builtin_types: also read Python's own exception types as the answer of a client
            library called directly (a tracker's backend): ``PermissionError`` is hard,
            ``TypeError``, ``ValueError`` and ``KeyError`` refuse the value. Without it (a
            storage), those are ``None``: a missing file or a bug.
    """
    found: str | None = None
    for one in causes(error) if chain else (error,):
        kind = _one(one, builtin_types)
        if kind == HARD:
            return HARD
        found = found or kind
    return found
