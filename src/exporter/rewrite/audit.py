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
    node: str = ""  # graph node of the softmax, for sites found in a traced graph
    pattern: str = ""  # the ops matched, e.g. "matmul → div → masked_fill → softmax → matmul"


@dataclass
class AttentionAudit:
    sites: list[Site] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)  # per rule: rewritten vs original on sample 0

    def has_site_at(self, location: str) -> bool:
        """A site already listed at ``location`` or at a module that contains it."""
        return any(s.location and (location == s.location or location.startswith(s.location + "."))
                   for s in self.sites if s.status != SKIPPED)

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
            "checks": [dict(c) for c in self.checks],
        }
