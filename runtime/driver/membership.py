"""Which rollout servers the driver uses while the job scales: I/O-free bookkeeping.

The desired set comes from the job's config (endpoints.rollout, re-read while the job runs); the
driver (runtime/driver/loop.py) does the I/O each transition asks for:

    desired, not known      -> joining   (wait until /health answers)
    joining, healthy        -> ready     (the next weight sync re-forms the group with it)
    ready, synced           -> member    (in the weight-sync group at the current version: the
                                          endpoint pool sends it requests from then on)
    member, not desired     -> draining  (no new requests; in flight: finished, or aborted and
                                          resumed elsewhere under partial rollouts)
    draining, none in flight-> gone      (out of the group's next epoch; its pod may go)

A server must not be taken away while `held()` lists it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RolloutMembership:
    members: list[str]
    """In the weight-sync group and the endpoint pool (draining ones included), in group order."""
    joining: list[str] = field(default_factory=list)
    ready: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    added: int = 0
    """Servers that joined while the job ran."""
    removed: int = 0
    """Servers drained and let go while the job ran."""

    def update(self, desired: Sequence[str]) -> tuple[list[str], list[str]]:
        """Take a new desired set; returns (servers to start admitting, servers to start
        draining). A server no longer desired before it joined is forgotten; one desired again
        while it drains finishes draining and is admitted afresh afterwards."""
        want = list(dict.fromkeys(desired))
        if not want:
            raise ValueError("endpoints.rollout is empty: a job needs at least one rollout server")
        self.joining = [u for u in self.joining if u in want]
        self.ready = [u for u in self.ready if u in want]
        known = {*self.members, *self.joining, *self.ready}
        admit = [u for u in want if u not in known]
        drain = [u for u in self.members if u not in want and u not in self.draining]
        self.joining += admit
        self.draining += drain
        return admit, drain

    def healthy(self, url: str) -> bool:
        """A joining server answered /health; False if it is no longer wanted."""
        if url not in self.joining:
            return False
        self.joining.remove(url)
        self.ready.append(url)
        return True

    def wanted(self, url: str) -> bool:
        return url in self.joining or url in self.ready

    def joined(self, urls: Sequence[str]) -> None:
        """The sync that re-formed the group with `urls` (the ready servers it took) succeeded.
        One no longer wanted by now (a scale-down came meanwhile) drains at the next update."""
        self.members += [u for u in urls if u not in self.members]
        self.ready = [u for u in self.ready if u not in urls]
        self.added += len(urls)

    def drained(self, url: str) -> None:
        self.members.remove(url)
        self.draining.remove(url)
        self.removed += 1

    def serving(self) -> list[str]:
        """Members that take new requests."""
        return [u for u in self.members if u not in self.draining]

    def held(self) -> list[str]:
        """Every server the driver uses or is about to: none of them may be taken away."""
        return list(dict.fromkeys([*self.members, *self.ready, *self.joining]))
