"""Config choices as enums: Hydra refuses a misspelt value when the config is composed, before any stage runs,
and lists the valid ones. Members compare, format and serialize as their plain string value, so manifests,
run names and code written against strings are unchanged."""
from __future__ import annotations

from enum import Enum
from typing import TypeVar

C = TypeVar("C", bound="Choice")


class Choice(str, Enum):
    # Member names equal their values: OmegaConf matches YAML strings to enum members by name.
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls: type[C], value, key: str) -> C:
        """`value` (a member or its string) as a member; a clear error naming the key and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: choose one of {', '.join(m.value for m in cls)}") from None
