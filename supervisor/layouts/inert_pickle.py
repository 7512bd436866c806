"""Checkpoint pickles read without running them, and without torch: every class or function a pickle names
becomes a :class:`Stub` (or one of a few real containers), or is refused. The layouts that read a pickle's
structure (Lightning's ``data.pkl``, DeepSpeed's model states, DCP's ``.metadata``) share this one rule, so a
hostile pickle runs nothing and reading one costs no ``import torch`` (1-2 s of CPU in an ``rlsup`` command)."""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any, Callable, Mapping

# Attributes a Stub keeps for itself: a pickle's state never overwrites them
_OWN = frozenset({"args", "kwargs", "state", "items", "append", "extend"})


class Stub:
    """Stands in for any class or function a pickle names: records what it was given, runs nothing. A state dict
    (a dataclass's fields, as DCP's metadata classes pickle them) also reads as attributes."""

    args: tuple = ()
    kwargs: dict = {}
    state: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state
        for part in state if isinstance(state, tuple) else (state,):  # (dict, slots) or dict
            if isinstance(part, dict):
                for key, value in part.items():
                    if isinstance(key, str) and not key.startswith("__") and key not in _OWN:
                        setattr(self, key, value)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("items", {})[key] = value

    def append(self, value: Any) -> None:
        items = self.__dict__.setdefault("items", {})
        items[len(items)] = value

    def extend(self, values: Any) -> None:
        for value in values:
            self.append(value)


def _bytearray(*args: Any) -> bytearray:
    """``bytearray`` of bytes or of a string and its encoding, as pickle writes one; never ``bytearray(size)``, which
    a few bytes of pickle could make gigabytes."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise pickle.UnpicklingError(f"refusing bytearray({type(args[0]).__name__})")
    return bytearray(*args)


def _member(owner: Any, name: Any) -> Any:
    """``getattr(EnumClass, "NAME")``, as some Python versions pickle an enum member (3.11.2 does; 3.11.7 calls the
    class with its value): a stub of that member, only for a stubbed class and a plain name. The real ``getattr``
    would let a pickle walk from any object to anything."""
    if isinstance(owner, type) and issubclass(owner, Stub) and isinstance(name, str) and not name.startswith("_"):
        return owner(name)
    raise pickle.UnpicklingError("refusing getattr on anything but a stubbed class")


#: Names a checkpoint pickle may build as themselves: plain containers (and an enum member of a stubbed class),
#: nothing that runs code
PLAIN = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "getattr"): _member,
}


class InertUnpickler(pickle.Unpickler):
    """``real``: names built as themselves (plain containers); ``stubbed(module, name)``: names that become a
    Stub; anything else raises ``refusing to unpickle MODULE.NAME`` + ``refusal``. Persistent ids (torch.save's
    tensor storages) become ``storage``: their bytes are never read."""

    def __init__(self, data: bytes, real: Mapping[tuple[str, str], Any], stubbed: Callable[[str, str], bool],
                 refusal: str = "", storage: Any = None) -> None:
        super().__init__(io.BytesIO(data))
        self.real, self.stubbed, self.refusal, self.storage = real, stubbed, refusal, storage
        self._stubs: dict[tuple[str, str], type] = {}  # one per name, for this read only (a pickle may name many)

    def find_class(self, module: str, name: str) -> Any:
        real = self.real.get((module, name))
        if real is not None:
            return real
        if self.stubbed(module, name):
            key = (module, name)
            if key not in self._stubs:  # named after it, for a reader's repr
                self._stubs[key] = type(name, (Stub,), {"__module__": f"rlsup_stub.{module}"})
            return self._stubs[key]
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}{self.refusal}")

    def persistent_load(self, pid: Any) -> Any:
        return self.storage


__all__ = ["InertUnpickler", "PLAIN", "Stub"]
