"""One inbox name is one consumer group: a second group on the same name is refused at
start-up, before it could drop the first group's events as duplicates."""

from __future__ import annotations

import pytest

from consumer_sdk import ConfigError, InboxConsumer, InboxGroupConflict
from tests.integration.sdk._support import make_config


def test_a_second_group_on_one_inbox_name_is_refused(sdk_db, broker, sdk_topic):
    first = InboxConsumer(make_config(sdk_db, broker, sdk_topic, name="shared-inbox", group_id="billing"),
                          lambda conn, message: None)
    first.start()
    try:
        again = InboxConsumer(make_config(sdk_db, broker, sdk_topic, name="shared-inbox", group_id="billing"),
                              lambda conn, message: None)
        again.start()  # the same group: a second member, fine
        again.close()
        other = InboxConsumer(make_config(sdk_db, broker, sdk_topic, name="shared-inbox", group_id="audit"),
                              lambda conn, message: None)
        with pytest.raises(InboxGroupConflict, match="belongs to consumer group 'billing', not 'audit'") as info:
            other.start()
        assert isinstance(info.value, ConfigError)
        other.close()
    finally:
        first.close()
