"""Offline stand-in for ``evaluate.load("glue", "mrpc")``: accuracy and F1 of the positive class."""

from __future__ import annotations

from typing import Any

__all__ = ["load"]


class _GlueMrpc:
    def __init__(self) -> None:
        self._predictions: list[int] = []
        self._references: list[int] = []

    def add_batch(self, predictions: Any = None, references: Any = None) -> None:
        self._predictions.extend(int(p) for p in _as_list(predictions))
        self._references.extend(int(r) for r in _as_list(references))

    def compute(self, predictions: Any = None, references: Any = None) -> dict[str, float]:
        if predictions is not None:
            self.add_batch(predictions, references)
        p, r = self._predictions, self._references
        self._predictions, self._references = [], []
        tp = sum(1 for a, b in zip(p, r) if a == 1 and b == 1)
        fp = sum(1 for a, b in zip(p, r) if a == 1 and b == 0)
        fn = sum(1 for a, b in zip(p, r) if a == 0 and b == 1)
        accuracy = sum(1 for a, b in zip(p, r) if a == b) / len(p) if p else 0.0
        f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        return {"accuracy": accuracy, "f1": f1}


def _as_list(values: Any) -> list[Any]:
    if values is None:
        return []
    if hasattr(values, "tolist"):
        return list(values.tolist())
    return list(values)


def load(path: str, config_name: str | None = None, **_: Any) -> _GlueMrpc:
    """The stand-in metric; only GLUE MRPC exists here."""
    if path.split("/")[-1] == "glue" and config_name == "mrpc":
        return _GlueMrpc()
    raise ValueError(
        f"the offline evaluate stand-in has no metric {path!r}/{config_name!r}; it serves "
        "('glue', 'mrpc'). Add it to tests/compat/standins/evaluate/__init__.py"
    )
