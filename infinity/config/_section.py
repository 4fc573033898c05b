"""What every config section shares: the class-level tables the parser reads.

A section is a `@dataclass(kw_only=True, frozen=True)` whose field names are DeepSpeed's JSON keys,
so `config.zero_optimization.stage3_max_live_parameters` reads like the JSON it came from.
"""

from __future__ import annotations

from typing import ClassVar


class Section:
    """Base of the config sections (no fields of its own).

    NOT_HONOURED: field -> why Infinity accepts the DeepSpeed key but does not act on it. Keys in
        it that the user wrote are logged once at load, and docs/engine.md lists them all.
    ALIASES: old or alternative key -> the field it sets (e.g. aio's `thread_count`).
    NO_AUTO: fields for which "auto" makes no sense (a type name, a path).
    OPAQUE: keys accepted with any value and never read (whole features Infinity lacks).
    INTERNAL: fields that are not JSON keys (set by load_config).
    SECTION_REASON: why the whole section is accepted but not acted on; None if it is.
    """

    NOT_HONOURED: ClassVar[dict[str, str]] = {}
    ALIASES: ClassVar[dict[str, str]] = {}
    NO_AUTO: ClassVar[frozenset[str]] = frozenset()
    OPAQUE: ClassVar[dict[str, str]] = {}
    INTERNAL: ClassVar[frozenset[str]] = frozenset()
    SECTION_REASON: ClassVar[str | None] = None
