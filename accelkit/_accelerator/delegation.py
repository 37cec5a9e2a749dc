"""How the :class:`~accelkit.Accelerator` facade hands a method to one of its parts.

A delegated method keeps the part method's name, signature and docstring, so the public
documentation of a member lives with the code that implements it, and its types stay checked
(``ParamSpec``): ``print = forward(Processes.print, processes_of)`` in the class body.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, TypeVar

from typing_extensions import ParamSpec

__all__ = ["documented_by", "forward"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Host = TypeVar("_Host")
_Part = TypeVar("_Part")
_Function = TypeVar("_Function", bound=Callable[..., Any])


def forward(
    method: Callable[Concatenate[_Part, _P], _R], part: Callable[[_Host], _Part]
) -> Callable[Concatenate[_Host, _P], _R]:
    """A method of the host class that calls ``method`` on ``part(self)``.

    Args:
        method: the part's method, taken from its class (``Processes.print``).
        part: returns the host's part (``lambda host: host._processes`` as a named function).

    Returns:
        A function to assign in the host's class body; it has ``method``'s metadata.
    """

    @functools.wraps(method)
    def delegate(self: _Host, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return method(part(self), *args, **kwargs)

    return delegate


def documented_by(source: Callable[..., Any]) -> Callable[[_Function], _Function]:
    """Give the decorated method the docstring of the part method it delegates to (for methods
    that must stay written out, e.g. to keep their ``@overload`` s)."""

    def document(method: _Function) -> _Function:
        method.__doc__ = source.__doc__
        return method

    return document
