"""Attribute patching shared by the scheduler and worker seams.

A seam replaces one attribute that vLLM defines on a module or class. Installing is
validate-then-apply: every target is checked (it exists on that exact owner, and no
subclass overrides a patched method, which would silently bypass the seam) before the
first ``setattr``. Restoring puts back exactly what was there, in reverse order, and
deletes attributes the owner did not define itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvcached.errors import IntegrationError

#: Marks "the owner had no attribute of its own under this name".
MISSING: Any = object()

#: One planned replacement: ``(owner, attribute name, replacement)``.
Seam = tuple[Any, str, Any]


def own(owner: Any, name: str) -> Any:
    """``owner``'s own attribute ``name`` (not inherited), or `MISSING`."""
    return vars(owner).get(name, MISSING)


def subclasses(cls: type) -> list[type]:
    """Every subclass of ``cls``, transitively."""
    out: list[type] = []
    direct: list[type] = cls.__subclasses__()
    for sub in direct:
        out.append(sub)
        out.extend(subclasses(sub))
    return out


def require_own(owner: Any, name: str, *, exclusive: bool = True) -> Callable[..., Any]:
    """``owner.name``, which must be a callable defined on ``owner`` itself.

    With ``exclusive`` (the default), a class owner must have no subclass overriding it.
    """
    value = own(owner, name)
    label = getattr(owner, "__qualname__", getattr(owner, "__name__", repr(owner)))
    if value is MISSING or not callable(value):
        raise IntegrationError(f"{label}.{name} is not defined where kvcached expects it")
    if exclusive and isinstance(owner, type):
        for sub in subclasses(owner):
            if name in vars(sub):
                raise IntegrationError(f"{sub.__qualname__} overrides {label}.{name}; the seam would miss it")
    return value


def require_vllm_helper(module: Any, name: str, utils: Any) -> Callable[..., Any]:
    """``module.name``, which must still be the helper of that name in ``utils`` (the module
    vLLM imported it from): a name another plugin already replaced is refused."""
    helper = require_own(module, name)
    if helper is not getattr(utils, name, None):
        raise IntegrationError(
            f"{module.__name__}.{name} is not vLLM's helper; another plugin already replaced it"
        )
    return helper


@dataclass(frozen=True, slots=True)
class _Patch:
    owner: Any
    name: str
    original: Any  # the owner's own attribute, or MISSING


class PatchSet:
    """Replaced attributes, restorable exactly. Not thread-safe: callers hold their lock."""

    def __init__(self) -> None:
        self._patches: list[_Patch] = []

    def __bool__(self) -> bool:
        return bool(self._patches)

    def apply(self, plan: Iterable[Seam]) -> None:
        """Apply ``(owner, name, replacement)`` triples; the plan was validated by its builder."""
        for owner, name, replacement in plan:
            self._patches.append(_Patch(owner, name, own(owner, name)))
            setattr(owner, name, replacement)

    def restore(self) -> None:
        """Undo every replacement, newest first; idempotent."""
        while self._patches:
            patch = self._patches.pop()
            if patch.original is MISSING:
                delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, patch.original)
