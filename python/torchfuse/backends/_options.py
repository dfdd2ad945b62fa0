"""The machinery behind torchfuse.backends.conv and torchfuse.backends.matmul:
module attributes that read and write the C++ options
(include/torchfuse/backends.h), validated, and a flags() context manager."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Dict, Iterator


class Option:
    """One option: its C++ getter and setter, and a check that raises
    TypeError or ValueError naming the option, what it expects and what it
    got."""

    def __init__(self, name: str, getter: Callable[[], Any], setter: Callable[[Any], None],
                 check: Callable[[str, Any], Any]):
        self.name, self.getter, self.setter, self.check = name, getter, setter, check

    def __get__(self, module, owner=None):
        return self.getter()

    def __set__(self, module, value):
        self.setter(self.check(f"{module.__name__}.{self.name}", value))


def choice(*choices: str) -> Callable[[str, Any], str]:
    listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"

    def check(what: str, value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"{what}: expected {listed}, got the {type(value).__name__} {value!r}")
        if value not in choices:
            raise ValueError(f"{what}: expected {listed}, got {value!r}")
        return value

    return check


def boolean(what: str, value: Any) -> bool:
    # NB: bool only: 0 and 1 would pass a truthiness test, "never" too.
    if not isinstance(value, bool):
        raise TypeError(f"{what}: expected True or False, got the {type(value).__name__} {value!r}")
    return value


def int_range(lo: int, hi: int, zero_means: str) -> Callable[[str, Any], int]:
    def check(what: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what}: expected an int, 0 ({zero_means}) or from {lo} to {hi}, "
                            f"got the {type(value).__name__} {value!r}")
        if value != 0 and not lo <= value <= hi:
            raise ValueError(f"{what}: expected 0 ({zero_means}) or an int from {lo} to {hi}, "
                             f"got {value}")
        return value

    return check


def install(module: types.ModuleType, options: Dict[str, Option]) -> None:
    """Makes each option a module attribute (as torch.backends.cudnn's are)
    and adds flags()."""

    class OptionsModule(types.ModuleType):
        def __setattr__(self, name, value):
            # NB: a misspelt option would otherwise create a new attribute
            # silently, and change nothing.
            if name.startswith("_") or name in options or name in self.__dict__:
                return super().__setattr__(name, value)
            raise AttributeError(f"{self.__name__} has no option {name!r}; "
                                 f"the options are {', '.join(options)}")

    for name, option in options.items():
        setattr(OptionsModule, name, option)

    @contextlib.contextmanager
    def flags(**values: Any) -> Iterator[None]:
        unknown = [n for n in values if n not in options]
        if unknown:
            raise TypeError(f"{module.__name__}.flags: unknown option {unknown[0]!r}; "
                            f"the options are {', '.join(options)}")
        # every value checked before any is set: a bad one changes nothing
        checked = {n: options[n].check(f"{module.__name__}.flags: {n}", v)
                   for n, v in values.items() if v is not None}
        saved = {n: options[n].getter() for n in options}
        try:
            for n, v in checked.items():
                options[n].setter(v)
            yield
        finally:
            for n, v in saved.items():
                options[n].setter(v)

    flags.__doc__ = (f"Sets the given options of {module.__name__} (None: unchanged) for the "
                     "block and restores every option after it.")
    module.flags = flags
    module.__class__ = OptionsModule
