"""Small value classes without the ``dataclasses`` module.

``ps``, ``doctor`` and the CLI import the modules that define their records on every run;
building a dataclass runs ``exec`` for each generated method and imports ``inspect``, which
cost more than the rest of ``ps``. These bases give a class with ``__slots__`` and its own
explicit ``__init__`` what a dataclass would: equality and ``repr`` over its fields (the
``__slots__``, in order) and, for :class:`Frozen`, immutability and a hash.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    _T = TypeVar("_T", bound="Plain")


class Plain:
    """Fields are the ``__slots__``; equal when of the same class with equal fields (and so,
    being mutable, unhashable, as a dataclass is)."""

    __slots__: tuple[str, ...] = ()

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__qualname__}({fields})"


class Frozen(Plain):
    """A :class:`Plain` whose fields cannot be assigned after ``__init__`` (which sets them
    with ``object.__setattr__``); hashable by its fields."""

    __slots__: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of {type(self).__name__}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of {type(self).__name__}")

    def __hash__(self) -> int:
        return hash(tuple([getattr(self, n) for n in self.__slots__]))


def replace(obj: _T, **changes: Any) -> _T:
    """A copy of ``obj`` with some fields changed (as ``dataclasses.replace``).

    Raises:
        TypeError: a name that is not a field of ``obj``.
    """
    unknown = set(changes) - set(obj.__slots__)
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
    fields = {n: getattr(obj, n) for n in obj.__slots__}
    fields.update(changes)
    return type(obj)(**fields)
