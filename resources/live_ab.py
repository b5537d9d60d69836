"""Live A/B settings: whether a gated candidate enters as challenger, its share of traffic, and
the sequential test's parameters."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field


class LiveAB(ConfigurableResource):
    """How a candidate that passed the held-out gate reaches the champion's place.

    Attributes:
        enabled: off (default): the candidate is promoted at once. On (``FLOWOPT_LIVE_AB=1``): it
            becomes the challenger; the gateway serves it to ``share`` of the sessions asking for
            ``model="policy"``, ``ab_test_report`` tests it on that live traffic after every
            batch, and ``ab_monitor_sensor`` promotes it or withdraws it when the test decides.
        share: the challenger's share of sessions, in (0, 1) (``FLOWOPT_LIVE_AB_SHARE``, 0.1).
        alpha: the sequential test's error rate (always valid: it holds however often it is
            checked), split between "better" and "worse".
        min_samples_per_arm / max_samples_per_arm: labelled trajectories per adapter before any
            decision / after which an undecided test ends (the challenger is withdrawn, the
            champion kept).
    """

    enabled: bool = Field(False, description="candidates that pass the gate enter live A/B instead of being promoted")
    share: float = Field(0.1, gt=0.0, lt=1.0, description="the challenger's share of live sessions")
    alpha: float = Field(0.05, gt=0.0, lt=1.0, description="the sequential test's error rate")
    min_samples_per_arm: int = Field(20, ge=1, description="labelled trajectories per adapter before any decision")
    max_samples_per_arm: int = Field(5000, ge=2, description="labelled trajectories per adapter after which an undecided test ends")
