"""Tiers of the store, fastest first."""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    """Where a copy of a tensor lives; a lower value is faster and smaller."""

    DEVICE = 0  # accelerator memory (host memory with its own budget when there is none)
    HOST = 1  # pinned host memory
    NVME = 2  # the swap file on NVMe (or any file system)

    @classmethod
    def of(cls, tier: Tier | str) -> Tier:
        """Accept a Tier or its name ("device", "host", "nvme")."""
        if isinstance(tier, Tier):
            return tier
        try:
            return cls[str(tier).upper()]
        except KeyError:
            raise ValueError(f"tier must be 'device', 'host' or 'nvme', got {tier!r}") from None

    @property
    def label(self) -> str:
        return self.name.lower()
