"""Property test of the Debezium column mapping's topic template (issue 9): literal text
of Kafka's topic characters comes back verbatim from the database, fields become the
column values, and anything else (any other character: a topic Kafka refuses, or SQL
pasted in) is a clean ConfigError; no input is ever pasted into SQL."""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from relay.adopt import topic_expression
from relay.errors import ConfigError

COLUMNS = {"aggregatetype": "Order'; DROP TABLE x; --", "aggregateid": "o-1", "type": "Created",
           "id": "6f1c0b0e-0000-4000-8000-000000000000"}
TOPIC_CHARACTERS = "ABCXYZabcxyz0189._-"
literal = st.text(alphabet=TOPIC_CHARACTERS, max_size=12)
hostile = st.text(alphabet=st.characters(blacklist_characters="{}\x00", blacklist_categories=("Cs",)),
                  min_size=1, max_size=12).filter(lambda t: any(c not in TOPIC_CHARACTERS and not c.isalnum()
                                                                or not c.isascii() for c in t))
field = st.sampled_from(sorted(COLUMNS))


@pytest.fixture(scope="module")
def conn(pg_server):
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as c:
        yield c


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.tuples(literal, field), min_size=1, max_size=3), tail=literal)
def test_templates_render_literally(conn, parts, tail) -> None:
    template = "".join(f"{text}{{{name}}}" for text, name in parts) + tail
    expected = "".join(text + COLUMNS[name] for text, name in parts) + tail
    row = sql.SQL("SELECT {} FROM (SELECT {}::text AS aggregatetype, {}::text AS aggregateid, "
                  "{}::text AS type, {}::text AS id) AS t").format(
        topic_expression(template), *(sql.Literal(COLUMNS[c]) for c in
                                      ("aggregatetype", "aggregateid", "type", "id")))
    assert conn.execute(row).fetchone()[0] == expected


@settings(max_examples=100, deadline=None)
@given(text=hostile, name=field)
def test_text_that_is_not_of_topic_characters_is_refused(text, name) -> None:
    """'bad topic {type}' routed rows to the topic 'bad topic created', which Kafka refuses."""
    with pytest.raises(ConfigError, match="topic characters"):
        topic_expression(f"{text}{{{name}}}")


@settings(max_examples=200, deadline=None)
@given(template=st.text(max_size=40))
def test_any_text_is_a_template_or_a_clean_error(template) -> None:
    try:
        expression = topic_expression(template)
    except ConfigError as exc:
        assert "--topic-template" in str(exc) and "\n" not in str(exc).strip()
    else:
        assert isinstance(expression, sql.Composable)
