"""Keep it locally, deliver it later: what checkpoint storage, replication and the trackers share.

- :mod:`~accelkit.delivery.failures` -- one classification of a failure: ``TRANSIENT``
  (retry it), ``HARD`` (retrying cannot help), ``REFUSED`` (skip this item), by exception type,
  error code and HTTP status, never message text.
- :mod:`~accelkit.delivery.retry` -- one backoff: ``RetryPolicy`` (exponential, capped,
  optionally jittered), ``retry_call`` and ``Backoff`` (the schedule of a service that stopped
  answering).
- :mod:`~accelkit.delivery.drain` -- one drain: ``Deadline``, ``drain(done, deadline, wait)``
  and ``ReportOnce``.
- :mod:`~accelkit.delivery.exit` -- one exit drain: the saves in flight, then the replication
  queue, then the trackers (``at_exit(callback, phase)``), in that order whoever registered first.

A low room: it imports only ``accelkit.errors``, and no client library (botocore, requests) at
all; their errors are read by class names and attributes.
"""

from accelkit.delivery.drain import Deadline, ReportOnce, drain
from accelkit.delivery.failures import HARD, REFUSED, TRANSIENT, classify, error_code
from accelkit.delivery.retry import Backoff, RetryPolicy, retry_call

__all__ = [
    "HARD",
    "REFUSED",
    "TRANSIENT",
    "Backoff",
    "Deadline",
    "ReportOnce",
    "RetryPolicy",
    "classify",
    "drain",
    "error_code",
    "retry_call",
]
