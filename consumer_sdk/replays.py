"""Replays at the consumer: which replayed events a service applies once more.

The relay republishes retained events with their original ``event_id`` and a
``replay_id`` header (``outbox-relay replay``).  By default the inbox drops them as the
duplicates they are.  A service that opts in to a replay (``InboxConfig.apply_replays``)
applies each event of that replay once more, exactly once: its inbox key becomes
``<name>/replay/<replay_id>``, so the inbox row of the original delivery does not
count, and a redelivery of the replayed copy does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from consumer_sdk.model import Claim, InboxMessage

REPLAY_HEADER = "replay_id"


def inbox_key(consumer: str, message: InboxMessage, apply_replays: frozenset[str]) -> str:
    """The inbox key (``outbox_inbox.consumer``) under which ``message`` is deduplicated."""
    replay_id = message.header(REPLAY_HEADER)
    if replay_id is not None and replay_id in apply_replays:
        return f"{consumer}/replay/{replay_id}"
    return consumer


class ReplayingInbox:
    """An inbox store whose ``claim`` keys the events of opted-in replays apart;
    everything else is the wrapped store's."""

    def __init__(self, store: Any, apply_replays: Iterable[str]) -> None:
        self._store = store
        self.apply_replays = frozenset(str(r) for r in apply_replays)
        self._keys: dict[Any, str] = {}  # event_id -> inbox key, of the last claim_many

    def claim(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None) -> Claim:
        key = inbox_key(consumer, message, self.apply_replays)
        result: Claim = self._store.claim(consumer=key, message=message, payload_sha256=payload_sha256)
        return result

    def claim_and_apply(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None,
                        statements: Sequence[tuple[Any, Any]]) -> bool | None:
        """The wrapped store's one-trip transaction (if it has one), under the event's inbox key."""
        inner = getattr(self._store, "claim_and_apply", None)
        if inner is None:  # a store without the path (the in-memory fakes): the usual way
            return None
        done: bool | None = inner(consumer=inbox_key(consumer, message, self.apply_replays), message=message,
                                  payload_sha256=payload_sha256, statements=statements)
        return done

    def send_trip(self, *, consumer: str, message: InboxMessage, payload_sha256: bytes | None,
                  statements: Sequence[tuple[Any, Any]]) -> bool | None:
        """The wrapped store's chained transaction (if it has one), under the event's inbox key."""
        inner = getattr(self._store, "send_trip", None)
        if inner is None:
            return None
        sent: bool | None = inner(consumer=inbox_key(consumer, message, self.apply_replays), message=message,
                                  payload_sha256=payload_sha256, statements=statements)
        return sent

    def claim_many(self, *, consumer: str, messages: Sequence[InboxMessage],
                   digests: Sequence[bytes | None]) -> list[Claim]:
        """``claim`` for a batch: one call of the wrapped store per inbox key, order kept."""
        keys = [inbox_key(consumer, m, self.apply_replays) for m in messages]
        self._keys = {m.event_id: key for m, key in zip(messages, keys, strict=True) if key != consumer}
        claims: list[Claim | None] = [None] * len(messages)
        for key in dict.fromkeys(keys):
            picked = [i for i, k in enumerate(keys) if k == key]
            found = self._store.claim_many(consumer=key, messages=[messages[i] for i in picked],
                                           digests=[digests[i] for i in picked])
            for i, claim in zip(picked, found, strict=True):
                claims[i] = claim
        return [c for c in claims if c is not None]

    def unclaim(self, *, consumer: str, event_ids: Sequence[Any]) -> None:
        """Give back rows of the last ``claim_many``, each under the key it was claimed with."""
        by_key: dict[str, list[Any]] = {}
        for event_id in event_ids:
            by_key.setdefault(self._keys.get(event_id, consumer), []).append(event_id)
        for key, ids in by_key.items():
            self._store.unclaim(consumer=key, event_ids=ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def with_replays(store: Any, apply_replays: Iterable[str]) -> Any:
    """``store`` itself when no replay is opted in, else a :class:`ReplayingInbox` over it."""
    chosen = tuple(apply_replays)
    return ReplayingInbox(store, chosen) if chosen else store
