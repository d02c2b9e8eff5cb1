"""Who gets the free worker slots: pure logic, no I/O; time is passed in.

The pool has ``max_concurrency`` slots.  Queues are served in priority order
(the order the pool lists them, interactive first), each within its own limit,
so bulk work can never take the slots kept for interactive work.  Within a
queue, free slots go round-robin, one at a time, to the owners with ready work,
least recently served first: an owner with 10,000 jobs gets one slot per turn,
the same as an owner with one.  The per-owner limit (jobs of one owner running
at once across every worker) is applied here with the counts the database
reported, and again in the claim's SQL, which is what makes it hold across
processes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from consumer_sdk.jobs import _check
from consumer_sdk.jobs.errors import InvalidJob
from consumer_sdk.jobs.model import ClaimedJob, Lane, Take

LaneKey = tuple[str, str]

#: The most jobs one pool runs at once (a thread and a connection each).
MAX_CONCURRENCY = 10_000


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Concurrency limits.  ``max_concurrency`` and ``queue_limits`` are per pool (process);
    ``owner_limit``/``owner_limits`` hold across every worker sharing the database.

    Checked at construction (:class:`~consumer_sdk.jobs.errors.InvalidJob`, a ``ValueError``):
    ``max_concurrency`` an int from 1 to 10,000; ``queue_limits`` queue names to ints >= 0;
    ``owner_limit`` and ``owner_limits`` (owner ids to limits) ints >= 1; at most 2**31-1 each.
    """

    max_concurrency: int
    queue_limits: Mapping[str, int] = field(default_factory=dict)
    owner_limit: int = 1_000_000
    owner_limits: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check.integer("max_concurrency", self.max_concurrency, 1, MAX_CONCURRENCY)
        _check.integer("owner_limit", self.owner_limit, 1)
        for name, mapping, check_key, key_name, lowest in (
                ("queue_limits", self.queue_limits, _check.queue, "a queue_limits key", 0),
                ("owner_limits", self.owner_limits, _check.text, "an owner_limits key", 1)):
            if not isinstance(mapping, Mapping):
                raise InvalidJob(f"{name} must be a mapping of names to limits, got {mapping!r:.80}")
            for key, value in mapping.items():
                check_key(key_name, key)
                _check.integer(f"{name}[{key!r}]", value, lowest)

    def for_queue(self, queue: str) -> int:
        return min(self.max_concurrency, self.queue_limits.get(queue, self.max_concurrency))

    def for_owner(self, owner_id: str) -> int:
        return self.owner_limits.get(owner_id, self.owner_limit)


def plan(lanes: Sequence[Lane], *, queues: Sequence[str], busy: Mapping[str, int],
         limits: Limits, last_served: Mapping[LaneKey, float]) -> list[Take]:
    """The claims to make now, in the order to make them.

    ``busy`` is this pool's running jobs per queue; ``lanes`` the ready work the
    database reported (with each owner's running jobs in every queue), in the order to
    serve lanes served as long ago; ``last_served`` the monotonic time each lane last got
    a job (absent: never).
    """
    free_total = limits.max_concurrency - sum(busy.values())
    owner_room: dict[str, int] = {}
    takes: dict[LaneKey, int] = {}
    for queue in queues:
        if free_total <= 0:
            break
        room = min(free_total, limits.for_queue(queue) - busy.get(queue, 0))
        # Stable: among lanes served as long ago, the order of ``lanes`` (the database's, which
        # starts after the owner served last: see consumer_sdk.jobs.lanes).
        ordered = sorted((lane for lane in lanes if lane.queue == queue),
                         key=lambda lane: last_served.get((queue, lane.owner_id), float("-inf")))
        given = _round_robin(ordered, room, limits, owner_room, takes)
        free_total -= given
    return [Take(q, o, n, limits.for_owner(o)) for (q, o), n in takes.items() if n > 0]


def _round_robin(ordered: Sequence[Lane], room: int, limits: Limits,
                 owner_room: dict[str, int], takes: dict[LaneKey, int]) -> int:
    """Deal ``room`` slots one per lane per turn; returns how many were dealt."""
    given = 0
    progress = True
    while given < room and progress:
        progress = False
        for lane in ordered:
            if given >= room:
                break
            key = (lane.queue, lane.owner_id)
            left = owner_room.setdefault(lane.owner_id,
                                         limits.for_owner(lane.owner_id) - lane.running)
            if left <= 0 or takes.get(key, 0) >= lane.ready:
                continue
            takes[key] = takes.get(key, 0) + 1
            owner_room[lane.owner_id] = left - 1
            given += 1
            progress = True
    return given


class RoundRobin:
    """This pool's memory of when each lane was last served (monotonic seconds).

    Bounded: beyond ``max_lanes`` entries the oldest are forgotten, which only
    moves those lanes to the front of the line.
    """

    def __init__(self, *, max_lanes: int = 10_000) -> None:
        self.max_lanes = max_lanes
        self.last_served: dict[LaneKey, float] = {}

    def record(self, served: Iterable[LaneKey], now: float) -> None:
        for key in served:
            self.last_served.pop(key, None)  # re-insert: dict order stays oldest-first
            self.last_served[key] = now
        excess = len(self.last_served) - self.max_lanes
        if excess > 0:
            for key in list(self.last_served)[:excess]:
                del self.last_served[key]


def after_claim(lanes: list[Lane], takes: list[Take], claimed: list[ClaimedJob]) -> list[Lane]:
    """The lanes as they stand after this claim; [] (read them again) when it got less than
    planned: the lanes were stale, another worker was faster, or a limit bound."""
    if len(claimed) < sum(take.n for take in takes):
        return []
    got = Counter((job.queue, job.owner_id) for job in claimed)
    owners = Counter(job.owner_id for job in claimed)
    # A new Lane only for the few lanes whose owner was served: this runs every round.
    left = [lane if lane.owner_id not in owners else
            Lane(queue=lane.queue, owner_id=lane.owner_id, ready=lane.ready - got.get((lane.queue, lane.owner_id), 0),
                 running=lane.running + owners[lane.owner_id]) for lane in lanes]
    return [lane for lane in left if lane.ready > 0]


def after_round(lanes: list[Lane], takes: list[Take], claimed: list[ClaimedJob], written: Mapping[str, int],
                limits: Limits) -> tuple[list[Lane], bool]:
    """The lanes after a round that claimed ``claimed`` and completed this pool's jobs of
    ``written`` (owner: jobs), and True when one of those owners had ready work that its
    limit held back: a claim now can start it (the round's own statement still counted
    the jobs it completed as running), so another round should run at once."""
    after = after_claim(lanes, takes, claimed)  # [] when they must be read again
    if not written:  # the usual round of a pool without owner limits in play: nothing to adjust
        return after, False
    unblocked = False
    adjusted = []
    for lane in after or lanes:
        done = written.get(lane.owner_id, 0)
        if done:
            unblocked = unblocked or (lane.ready > 0 and lane.running >= limits.for_owner(lane.owner_id))
            lane = Lane(queue=lane.queue, owner_id=lane.owner_id, ready=lane.ready,
                        running=max(0, lane.running - done))
        adjusted.append(lane)
    return (adjusted if after else []), unblocked
