"""Small value classes without the ``dataclasses`` module.

``ps``, ``doctor`` and the CLI import the modules that define their records on every run;
building a dataclass runs ``exec`` for each generated method and imports ``inspect``, which
cost more than the rest of ``ps``. These bases give a class with ``__slots__`` and its own
explicit ``__init__`` what a dataclass would: equality and ``repr`` over its fields (the
``__slots__``, in order) and, for :class:`Frozen`, immutability and a hash.

:class:`Enum` and :class:`StrEnum` stand in for the ``enum`` module's, for the enums those
commands load (the error codes, liveness, ownership phases and causes, ps statuses): importing
``enum`` (with ``functools``, ``collections``, ``operator`` and ``types``) and building its
classes cost more instructions than all of a ``ps`` with 20 supervisors. Type checkers see the
``enum`` module's classes (so ``match`` on a member stays exhaustive); at run time these give
what this package uses of them, with the same results: members as class attributes in
definition order, lookup by value (``Cls(value)``, ``ValueError`` for none) and by name
(``Cls[name]``), iteration, ``len``, ``.name``/``.value``, the same ``str``, ``format``,
``repr``, equality and hash (a ``StrEnum`` member is its value as a ``str``; an ``Enum`` member
equals only itself and hashes as its name), members that cannot be reassigned, classes with
members that cannot be subclassed, and copies and pickles that are the member itself.
``isinstance(member, enum.Enum)`` is false; nothing here asks it.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from enum import Enum as Enum
    from enum import StrEnum as StrEnum
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


def enc_hook(obj: object) -> object:
    """The ``enc_hook`` of msgspec encoders: a :class:`StrEnum` member (a ``str`` subclass
    that is no ``enum.Enum``, which msgspec would refuse) is encoded as its value.

    Raises:
        TypeError: anything else, as msgspec says it without a hook.
    """
    if isinstance(obj, str):
        return str(obj)
    raise TypeError(f"Encoding objects of type {type(obj).__name__} is unsupported")


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


if not TYPE_CHECKING:

    def _is_sunder_or_dunder(key):
        n = len(key)
        return (n > 2 and key[0] == key[-1] == "_" and key[1] != "_" and key[-2] != "_") or (
            n > 4 and key[:2] == key[-2:] == "__" and key[2] != "_" and key[-3] != "_")

    class _EnumType(type):
        """The metaclass of :class:`Enum` and :class:`StrEnum`: as in ``enum``, a class's
        names that are not ``__dunder__``, ``_sunder_``, private (``_Name__x``) or descriptors
        (functions, properties) become its members, made by ``cls._member``."""

        def __new__(mcs, name, bases, ns):
            for base in bases:
                if getattr(base, "_members", None):
                    raise TypeError(f"{name}: cannot extend {base.__name__}")
            cls = super().__new__(mcs, name, bases, ns)
            members = {}
            if any(isinstance(b, _EnumType) for b in bases):
                private = f"_{name.lstrip('_')}__"
                for key, value in ns.items():
                    if not (_is_sunder_or_dunder(key) or key.startswith(private)
                            or hasattr(value, "__get__")):
                        member = cls._member(key, value)
                        type.__setattr__(cls, key, member)
                        members[key] = member
            type.__setattr__(cls, "_members", members)
            type.__setattr__(cls, "_by_value", {m._value_: m for m in members.values()})
            return cls

        def __call__(cls, value):
            if isinstance(value, cls):
                return value
            try:
                return cls._by_value[value]
            except (KeyError, TypeError):
                raise ValueError(f"{value!r} is not a valid {cls.__qualname__}") from None

        def __getitem__(cls, name):
            return cls._members[name]

        def __iter__(cls):
            return iter(list(cls._members.values()))

        def __len__(cls):
            return len(cls._members)

        def __contains__(cls, value):
            return isinstance(value, cls) and value._name_ in cls._members

        @property
        def __members__(cls):
            return dict(cls._members)

        def __setattr__(cls, name, value):
            if name in cls.__dict__.get("_members", ()):
                raise AttributeError(f"cannot reassign member {name!r}")
            super().__setattr__(name, value)

        def __delattr__(cls, name):
            if name in cls.__dict__.get("_members", ()):
                raise AttributeError(f"cannot delete member {name!r}")
            super().__delattr__(name)

    class _Member:
        """What both kinds of member have: ``.name``, ``.value``, ``repr`` and pickling."""

        __slots__ = ()

        @property
        def name(self):
            return self._name_

        @property
        def value(self):
            return self._value_

        def __repr__(self):
            return f"<{type(self).__name__}.{self._name_}: {self._value_!r}>"

        def __reduce_ex__(self, protocol):
            return type(self), (self._value_,)

    class Enum(_Member, metaclass=_EnumType):
        """A member equals only itself; ``str`` is ``Cls.NAME``."""

        __slots__ = ("_name_", "_value_")

        @classmethod
        def _member(cls, name, value):
            member = object.__new__(cls)
            object.__setattr__(member, "_name_", name)
            object.__setattr__(member, "_value_", value)
            return member

        def __str__(self):
            return f"{type(self).__name__}.{self._name_}"

        def __format__(self, spec):
            return format(str(self), spec)

        def __hash__(self):
            return hash(self._name_)

        def __copy__(self):
            return self

        def __deepcopy__(self, memo):
            return self

    class StrEnum(_Member, str, metaclass=_EnumType):
        """A member is its value as a ``str`` (equal to it, hashed as it, printed as it)."""

        @classmethod
        def _member(cls, name, value):
            if type(value) is not str:
                raise TypeError(f"{cls.__name__}.{name}: {value!r} is not a string")
            member = str.__new__(cls, value)
            member._name_ = name
            member._value_ = value
            return member

        __str__ = str.__str__
        __format__ = str.__format__

        def __copy__(self):
            return self

        def __deepcopy__(self, memo):
            return self
