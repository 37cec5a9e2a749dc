"""Fixtures shared by every test folder."""

from tests.fixtures.s3 import s3_server, s3_url

__all__ = ["s3_server", "s3_url"]
