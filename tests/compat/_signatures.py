"""Is a callable of accelkit bindable the way the reference's callable of the same name is?"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["incompatibilities"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _signature(obj: Any) -> inspect.Signature | None:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        sig = sig.replace(parameters=params[1:])
    return sig


def _opaque(sig: inspect.Signature) -> bool:
    # A decorator without functools.wraps leaves (*args, **kwargs): nothing to compare.
    kinds = {p.kind for p in sig.parameters.values()}
    return kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}


def incompatibilities(theirs: Any, ours: Any) -> list[str]:
    """What a call written for ``theirs`` could do that ``ours`` does not accept.

    A call is bindable the same way when: every positional parameter of the reference sits at
    the same position in accelkit (so positional calls mean the same thing); every parameter of
    the reference is accepted by name (or by ``**kwargs``); ``*args``/``**kwargs`` of the
    reference exist in accelkit; and accelkit requires nothing the reference does not.
    """
    if inspect.isclass(theirs) != inspect.isclass(ours):
        return [f"the reference's is a {'class' if inspect.isclass(theirs) else 'function'}"]
    t_sig, o_sig = _signature(theirs), _signature(ours)
    if t_sig is None or o_sig is None or _opaque(t_sig):
        return []
    o_params = o_sig.parameters
    o_kinds = {p.kind for p in o_params.values()}
    o_positional = [p.name for p in o_params.values() if p.kind in _POSITIONAL]
    problems: list[str] = []
    t_positional_index = 0
    for param in t_sig.parameters.values():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            if inspect.Parameter.VAR_POSITIONAL not in o_kinds:
                problems.append(f"no *{param.name}")
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            if inspect.Parameter.VAR_KEYWORD not in o_kinds:
                problems.append(f"no **{param.name}")
            continue
        if param.kind in _POSITIONAL:
            position = t_positional_index
            t_positional_index += 1
            if position >= len(o_positional):
                if inspect.Parameter.VAR_POSITIONAL not in o_kinds:
                    problems.append(f"{param.name!r} cannot be passed positionally (#{position})")
            elif o_positional[position] != param.name:
                problems.append(
                    f"positional #{position} is {o_positional[position]!r}, not {param.name!r}"
                )
        if param.name in o_params:
            if o_params[param.name].kind is inspect.Parameter.POSITIONAL_ONLY:
                problems.append(f"{param.name!r} is positional-only")
        elif inspect.Parameter.VAR_KEYWORD not in o_kinds:
            problems.append(f"no parameter {param.name!r}")
    for param in o_params.values():
        required = param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        theirs_param = t_sig.parameters.get(param.name)
        if required and (
            theirs_param is None or theirs_param.default is not inspect.Parameter.empty
        ):
            problems.append(f"{param.name!r} is required")
    return problems
