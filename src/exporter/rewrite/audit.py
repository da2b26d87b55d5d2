"""The attention audit: every attention site found, what was done to it, and why."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

REWRITTEN = "rewritten"
ALREADY_SDPA = "already_sdpa"
SKIPPED = "skipped"


@dataclass
class Site:
    location: str  # module path or graph node
    kind: str  # what computes the attention, e.g. "transformers AttentionInterface"
    status: str  # rewritten | already_sdpa | skipped
    rule: str = ""
    reason: str = ""
    causal: bool | None = None
    masked: bool | None = None
    grouped_query: bool | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None


@dataclass
class AttentionAudit:
    sites: list[Site] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def found(self) -> int:
        return len(self.sites)

    def count(self, status: str) -> int:
        return sum(1 for s in self.sites if s.status == status)

    def to_dict(self) -> dict:
        return {
            "found": self.found,
            "rewritten": self.count(REWRITTEN),
            "already_sdpa": self.count(ALREADY_SDPA),
            "skipped": self.count(SKIPPED),
            "sites": [asdict(s) for s in self.sites],
            "notes": list(self.notes),
        }
