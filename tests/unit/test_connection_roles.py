"""The relay's connection roles are one list (relay/connections.py ROLES): the start-up
check's connections and the wait watch's names both come from it."""

from __future__ import annotations

from relay.app import application_name
from relay.connections import LISTEN, ROLES, mark_role, relay_needs, watched_names


class _Pings:
    def ping(self) -> None: ...


def _name(role: str) -> str:
    return application_name("o", role)


def test_the_watch_names_every_needed_connection_but_listen_and_each_mark_connection() -> None:
    p = _Pings()
    needed = {n.name for n in relay_needs(_name, store=p, wakeup=p, mark_store=p, replay_store=p,
                                          cleanup_store=p, recovery_store=p)}
    watched = watched_names(_name, marks=3)
    assert needed - set(watched) == {LISTEN[0]}
    assert set(watched) - needed == {"outbox-relay:o:mark2", "outbox-relay:o:mark3"}
    assert len(watched) == len(ROLES) + 2


def test_mark_roles() -> None:
    assert [mark_role(i) for i in range(3)] == [":mark", ":mark2", ":mark3"]
