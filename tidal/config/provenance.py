"""Where each configuration value came from.

``tidal explain`` prints, next to every value, whether it is the built-in default, came from a
preset, a config file or a flag, or was derived by a named resolution rule. The parser records the
first four; ``resolve`` records the rules. Keys are flat field names (unique across sections).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Source:
    kind: str  # "default" | "preset" | "file" | "flag" | "derived"
    detail: str = ""  # preset name, file path, flag as typed, or "rule-id: why"

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


@dataclass
class Provenance:
    sources: dict[str, Source] = field(default_factory=dict)
    # Values the user gave before resolution changed them (a rule that overrides an explicit
    # setting, e.g. a critic forcing --offload-train); shown by explain so nothing changes silently.
    overridden: dict[str, tuple[object, Source]] = field(default_factory=dict)

    def of(self, name: str) -> Source:
        return self.sources.get(name, Source("default"))

    def set(self, name: str, kind: str, detail: str = "") -> None:
        self.sources[name] = Source(kind, detail)

    def explicit(self, name: str) -> bool:
        """Whether the user chose this value (preset, file or flag) rather than leaving the default."""
        return self.of(name).kind in ("preset", "file", "flag")

    def derive(self, name: str, rule: str, why: str, *, previous: object = None) -> None:
        src = self.of(name)
        if src.kind in ("preset", "file", "flag"):
            self.overridden[name] = (previous, src)
        self.sources[name] = Source("derived", f"{rule}: {why}")
