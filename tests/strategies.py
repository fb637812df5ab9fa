"""Hypothesis strategies derived from pydantic models and their field constraints."""

from __future__ import annotations

import types
from enum import Enum
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types as at
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

_TEXT = st.characters(exclude_categories=("Cs",))  # lone surrogates are not UTF-8


def models(model: type[BaseModel]) -> st.SearchStrategy[BaseModel]:
    """Valid instances of ``model``; drafts its validators reject are discarded."""
    fields = {
        name: for_type(info.annotation, tuple(info.metadata))
        for name, info in model.model_fields.items()
    }

    def validate(data: dict[str, Any]) -> BaseModel | None:
        try:
            return model.model_validate(data)
        except ValidationError:
            return None

    return st.fixed_dictionaries(fields).map(validate).filter(lambda m: m is not None)


def for_type(tp: Any, constraints: tuple[Any, ...] = ()) -> st.SearchStrategy[Any]:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *meta = get_args(tp)
        return for_type(base, constraints + tuple(_flatten(meta)))
    if origin in (Union, types.UnionType):
        return st.one_of([for_type(arg) for arg in get_args(tp)])
    if origin is tuple:
        return _sized(st.lists, for_type(get_args(tp)[0]), constraints).map(tuple)
    if origin is dict:
        return st.dictionaries(st.text(_TEXT, max_size=8), for_type(get_args(tp)[1]), max_size=3)
    return _scalar(tp, _bounds(constraints))


_JSON: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(_TEXT, max_size=8),
    lambda values: (
        st.lists(values, max_size=3)
        | st.dictionaries(st.text(_TEXT, max_size=8), values, max_size=3)
    ),
    max_leaves=8,
)
"""Any JSON value: what a field typed ``Any`` carries through the codec."""


def _scalar(tp: Any, bounds: dict[str, Any]) -> st.SearchStrategy[Any]:
    if tp is Any:
        return _JSON
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if isinstance(tp, type) and issubclass(tp, Enum):
        return st.sampled_from(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return models(tp)
    if tp is int:
        return st.integers(bounds.get("low"), bounds.get("high"))
    if tp is float:
        return st.floats(
            bounds.get("low"), bounds.get("high"), allow_nan=False, allow_infinity=False
        )
    if tp is str:
        return st.text(
            _TEXT, min_size=bounds.get("min_len", 0), max_size=min(bounds.get("max_len", 24), 24)
        )
    raise TypeError(f"no strategy for {tp!r}")


def _sized(
    lists: Any, elements: st.SearchStrategy[Any], constraints: tuple[Any, ...]
) -> st.SearchStrategy[list[Any]]:
    bounds = _bounds(constraints)
    return lists(elements, min_size=bounds.get("min_len", 0), max_size=3)


def _flatten(meta: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item in meta:
        out.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    return out


def _bounds(constraints: tuple[Any, ...]) -> dict[str, Any]:
    bounds: dict[str, Any] = {}
    for c in constraints:
        if isinstance(c, at.Ge):
            bounds["low"] = c.ge
        elif isinstance(c, at.Gt):
            bounds["low"] = c.gt + (1 if isinstance(c.gt, int) else 1e-9)
        elif isinstance(c, at.Le):
            bounds["high"] = c.le
        elif isinstance(c, at.Lt):
            bounds["high"] = c.lt - 1 if isinstance(c.lt, int) else c.lt * (1 - 1e-12)
        elif isinstance(c, at.MinLen):
            bounds["min_len"] = c.min_length
        elif isinstance(c, at.MaxLen):
            bounds["max_len"] = c.max_length
    return bounds
