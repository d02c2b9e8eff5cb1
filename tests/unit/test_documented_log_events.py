"""The log events README.md, the runbooks and the alert texts tell an SRE to search for are
events the code logs, with the level and fields they say: a renamed event would leave the
SRE grepping for nothing during an incident.  No server: the code is read with ``ast``.

What counts as an emitted event (:func:`emitted_events`): the first argument of a
``.debug/.info/.warning/.error/.critical/.exception(...)`` call when it is a snake_case
string literal, or a name or ``self.<attribute>`` the code assigns such literals to (a local
``event = "a" if ... else "b"``, a class's ``lock_wait_event = "..."``), or a parameter its
callers pass literals to (``_apply_fresh(..., failed="batch_handler_failed")``); also calls
through an alias (``log = self.log.warning if first else self.log.debug``).  Fields bound
with ``.bind(...)`` are not seen (no documented field needs them today).

What counts as a documented event (:func:`mentions`), in README.md, deploy/runbooks/*.md
and the alerts' summary/description annotations (events backticked in markdown, bare
snake_case words in the alerts' plain text):

* the events a log cue introduces — ``log``, ``logs``, ``logged``, ``log line(s)``,
  ``log event(s)``, ``Logs:`` (not "logs in", not PostgreSQL's / the pooler's / the transaction state log) —:
  the first within 40 characters of prose after the cue, then the ones chained to it by
  ``,`` ``;`` ``/`` ``and`` ``or`` ``then`` ``the`` (and their field lists); any other word
  ends the chain ("`kafka_connected` with `took_s`": the field is not an event);
* a backticked word followed by ``logged`` / ``is logged``;
* a backticked word followed by a level in parentheses: `` `x` (warning: ...)``, ``(an error)``.

Metric names and the relay's options and SDK settings are never events.  Parentheses right
after an event, or a colon and backticked words up to the sentence's end, give its level
and fields (:func:`field_list`): checked against the calls logging the event (their
keywords, ``**helper(...)`` resolved through the dict literals such helpers return).
Events the docs name only in prose ("the listener says it once too: `listen_failed`") are
not found by these rules; the rules are kept narrow so that a mention found is a log event."""

from __future__ import annotations

import ast
import difflib
import functools
import re
from collections import defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from consumer_sdk.config import InboxConfig
from consumer_sdk.jobs.config import WorkerConfig
from relay.options import OPTIONS
from tests.fixtures.deploy_names import exported_metric_names

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("relay", "consumer_sdk", "outbox_core", "outbox_embedded")
#: Outside the packages but named in README.md: the soak's consumers log `soak_offset_jump`.
EXTRA_SOURCES = ("tests/_soak_consumer.py",)
LEVELS = {"debug", "info", "warning", "error", "critical", "exception"}
EVENT = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
IDENT = re.compile(r"[a-z][a-z0-9_]*")
CUE = re.compile(r"(?<![\w'])[Ll]og(?:s|ged)?(?: lines?| events?)?\b:?(?! in\b)")
NOT_OURS = re.compile(r"(?:PostgreSQL(?:'s)?|pooler's|librdkafka's|state)\s*$")
TICKED = re.compile(r"`[a-z][a-z0-9]*(?:_[a-z0-9]+)+`")  # the markdown's events: backticked
BARE = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")  # the alerts' (plain text)
LEVEL_PAREN = re.compile(r"\s*(?:an? )?(debug|info|warning|error|critical)\s*(?:[:,)]|$)")
LEAD = 40  # the most prose between a cue and its first event ("logged once per state change (")

#: Documented events the code does not log, waiting for README.md to be mended (its wording
#: is in /tmp/s43/reports/h4.md): event -> what is wrong.  Empty it as README is fixed: an
#: entry no longer found fails too, so the list cannot go stale.
EXPECTED_DRIFT: dict[str, str] = {}


@dataclass
class Emitted:
    """Every call logging one event: each call's level and keyword names."""

    calls: list[tuple[str, frozenset[str], str]] = field(default_factory=list)  # level, keys, where


@dataclass(frozen=True)
class Mention:
    """An event the docs name, where, and the level and fields they give it (if any)."""

    event: str
    where: str
    level: str | None = None
    fields: tuple[str, ...] = ()


# -- the code ----------------------------------------------------------------------------------

def _strings(node: ast.AST | None) -> set[str]:
    """The snake_case literals an expression can evaluate to (``"a" if c else "b"``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and EVENT.fullmatch(node.value):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _strings(node.body) | _strings(node.orelse)
    return set()


def _dict_keys(node: ast.AST) -> set[str]:
    """The literal keys of the dicts a function returns (for ``**helper(...)`` fields)."""
    keys: set[str] = set()
    for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None):
        if isinstance(ret.value, ast.Dict):
            keys |= {k.value for k in ret.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(ret.value, ast.Call) and isinstance(ret.value.func, ast.Name) and ret.value.func.id == "dict":
            keys |= {k.arg for k in ret.value.keywords if k.arg}
    return keys


def _callee(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _levels(node: ast.AST) -> set[str]:
    """The levels a logging method or an alias of one stands for (``log.warning if c else log.debug``)."""
    if isinstance(node, ast.Attribute) and node.attr in LEVELS:
        return {"error" if node.attr == "exception" else node.attr}
    if isinstance(node, ast.IfExp):
        return _levels(node.body) | _levels(node.orelse)
    return set()


@functools.cache
def code_trees() -> dict[str, ast.Module]:
    """The packages' modules (and the extra sources), parsed once."""
    paths = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in paths + [ROOT / x for x in EXTRA_SOURCES]}


def emitted_events(trees: dict[str, ast.Module] | None = None) -> dict[str, Emitted]:
    """Event -> the calls logging it, over the packages' modules (or ``trees``, for tests).  A
    name as the event: the literals assigned to it in that module or passed to a keyword of
    that name (a parameter); ``self.<attribute>``: the literals assigned to the attribute in
    any module (a subclass's class attribute)."""
    trees = code_trees() if trees is None else trees
    assigned: dict[tuple[str, str], set[str]] = defaultdict(set)  # (module or "*", name) -> literals
    aliases: dict[tuple[str, str], set[str]] = defaultdict(set)  # (module, name) -> levels
    keyword_literals: dict[str, set[str]] = defaultdict(set)  # keyword -> literals passed
    returns: dict[str, set[str]] = defaultdict(set)  # function name -> keys of dicts returned
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for name in filter(None, map(_callee, node.targets)):
                    assigned[module, name] |= _strings(node.value)
                    assigned["*", name] |= _strings(node.value)
                    aliases[module, name] |= _levels(node.value)
            elif isinstance(node, ast.Call):
                for kw in node.keywords:
                    keyword_literals[kw.arg or ""] |= _strings(kw.value)
            elif isinstance(node, ast.FunctionDef):
                returns[node.name] |= _dict_keys(node)
    found: dict[str, Emitted] = defaultdict(Emitted)
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            levels = aliases.get((module, node.func.id), set()) if isinstance(node.func, ast.Name) \
                else _levels(node.func)
            if not levels:
                continue
            first = node.args[0]
            names = _strings(first)
            if isinstance(first, ast.Name):
                names = assigned[module, first.id] | keyword_literals[first.id]
            elif isinstance(first, ast.Attribute):
                names = assigned["*", first.attr]
            keys = {kw.arg for kw in node.keywords if kw.arg}
            for kw in node.keywords:
                if kw.arg is None and isinstance(kw.value, ast.Call) and (f := _callee(kw.value.func)):
                    keys |= returns[f]
            for name in names:
                found[name].calls += [(level, frozenset(keys), f"{module}:{node.lineno}") for level in levels]
    return dict(found)


# -- the docs ----------------------------------------------------------------------------------

def _paragraphs(markdown: str) -> list[str]:
    """Wrapped lines joined; blank lines, list items and table rows apart."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*|]|\d+\.)\s)", markdown):
        out += block.replace("\n", " ").split("|")
    return out


def _closing(text: str, start: int) -> int:
    """The index just past the parenthesis opened at ``start`` (or the text's end)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def field_list(inside: str) -> tuple[str | None, tuple[str, ...]]:
    """(level, fields) of the parentheses after an event: ``warning: `a`, `b`; ...``.  An item
    is a field when it starts with a backticked identifier, or when every item is a lone
    identifier ("(reason, offset)"); prose such as "(once, then every 30 s)" gives none."""
    level = None
    if m := LEVEL_PAREN.match(inside):
        level, inside = m.group(1), inside[m.end():]
    items = [i.strip() for i in re.split(r"[,;]", inside) if i.strip()]
    bare = all(IDENT.fullmatch(i.strip("`")) for i in items)
    found = [i.strip("`") if bare else i[1:].split("`")[0] for i in items if bare or i.startswith("`")]
    return level, tuple(f for f in found if IDENT.fullmatch(f))


def mentions(text: str, where: str, not_events: set[str], *, bare: bool = False) -> list[Mention]:
    """The events one paragraph names as log events (rules in the module's docstring)."""
    found: list[Mention] = []

    def take(word: re.Match[str], in_cue: bool) -> int:
        """Record the event at ``word``; return where scanning goes on (past its fields, given
        in parentheses or after a colon up to the sentence's end: "`x`: `a`, `b`.")."""
        name, end = word.group().strip("`"), word.end()
        if after := re.compile(r"\s*\(").match(text, end):
            end = _closing(text, after.end() - 1)
            level, keys = field_list(text[after.end():end - 1])
        elif after := re.compile(r":\s*(?=`)").match(text, end):
            stop = re.compile(r"\.(?:\s|$)").search(text, after.end())
            end = stop.start() if stop else len(text)
            level, keys = field_list(text[after.end():end])
        else:
            level, keys = None, ()
        if name not in not_events and (in_cue or (level and word.group().startswith("`"))):
            found.append(Mention(name, where, level, keys))
        return end

    for cue in CUE.finditer(text):
        if NOT_OURS.search(text[:cue.start()]):
            continue
        first = re.compile(r"`|\b[a-z]+_" if bare else "`").search(text, cue.end(), cue.end() + LEAD)
        pos = first.start() if first else len(text)
        while (word := (BARE if bare else TICKED).match(text, pos)) is not None:
            pos = take(word, in_cue=True)
            gap = re.compile(r"(?:[\s,;/()]|\b(?:and|or|then|the)\b)*").match(text, pos)
            pos = gap.end() if gap else pos
    for word in re.finditer(r"`[a-z][a-z0-9]*(?:_[a-z0-9]+)+`(?=,?\s+(?:is |are )?logged\b)", text):
        if not any(m.event == word.group().strip("`") for m in found):
            take(word, in_cue=True)
    for word in re.finditer(r"`[a-z][a-z0-9]*(?:_[a-z0-9]+)+`(?=\s*\()", text):
        if not any(m.event == word.group().strip("`") and m.level for m in found):
            take(word, in_cue=False)
    return found


def not_event_words() -> set[str]:
    """Words the docs use near a log cue that name something else: metrics, options, settings."""
    words = {n for n in exported_metric_names()} | {o.name for o in OPTIONS}
    return words | {f.name for f in fields(WorkerConfig)} | {f.name for f in fields(InboxConfig)}


def doc_texts() -> dict[str, str]:
    """Source -> paragraph texts: README.md, the runbooks, the alerts' summaries/descriptions."""
    texts = {"README.md": (ROOT / "README.md").read_text()}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "deploy" / "runbooks").glob("*.md"))}
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    for group in alerts["groups"]:
        for rule in group["rules"]:
            notes = rule.get("annotations", {})
            texts[f"alerts.yml:{rule.get('alert')}"] = "\n\n".join(
                notes.get(k, "").replace("\n", " ") for k in ("summary", "description"))
    return texts


def documented_events(texts: dict[str, str] | None = None) -> list[Mention]:
    not_events = not_event_words()
    return [m for where, text in (texts or doc_texts()).items()
            for para in _paragraphs(text) for m in mentions(para, where, not_events, bare=where.startswith("alerts"))]


def problems(documented: list[Mention], emitted: dict[str, Emitted]) -> dict[str, str]:
    """Event (or event.field) -> what is wrong, and where each doc says it: not logged, not at
    the level given, a field no call logging it passes."""
    out: dict[str, list[str]] = defaultdict(list)
    for m in documented:
        calls = emitted.get(m.event)
        if calls is None:
            out[m.event].append(f"{m.where}: not logged by the code")
            continue
        if m.level and not any(level == m.level for level, _, _ in calls.calls):
            levels = sorted({c[0] for c in calls.calls})
            out[m.event].append(f"{m.where}: documented at {m.level}, logged at {levels}")
        for name in (f for f in m.fields if not any(f in keys for _, keys, _ in calls.calls)):
            out[f"{m.event}.{name}"].append(f"{m.where}: a field no call logging it passes")
    return {key: "; ".join(dict.fromkeys(said)) for key, said in out.items()}


def near_misses(texts: dict[str, str], emitted: dict[str, Emitted], literals: set[str]) -> dict[str, str]:
    """The net under the narrow rules: a backticked word anywhere in the markdown that is
    almost an event the code logs (``difflib`` ratio >= 0.85: `listen_failed` for a code's
    ``listen_failures``) but is neither logged nor any string literal of the code (a reason
    or cause label such as `lease_expired`, a column) nor a metric or setting: most likely an
    event renamed on one side only."""
    known = set(emitted) | literals | not_event_words()
    out: dict[str, str] = {}
    for where, text in texts.items():
        for word in sorted(set(re.findall(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`", text)) - known):
            if close := difflib.get_close_matches(word, list(emitted), n=1, cutoff=0.85):
                out[word] = f"{where}: not in the code; the code logs {close[0]!r}"
    return out


def code_literals(trees: dict[str, ast.Module]) -> set[str]:
    return {n.value for tree in trees.values() for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


# -- the tests ---------------------------------------------------------------------------------

@functools.cache
def _the_code() -> dict[str, Emitted]:
    return emitted_events()


@functools.cache
def _the_docs() -> tuple[Mention, ...]:
    return tuple(documented_events())


def test_every_documented_log_event_is_logged_with_its_level_and_fields() -> None:
    documented = list(_the_docs())
    print("\n".join(sorted({f"{m.event} {m.level or ''} {m.fields or ''} ({m.where})" for m in documented})))
    found = problems(documented, _the_code())
    found |= near_misses(doc_texts(), _the_code(), code_literals(code_trees()))
    unexpected = {k: v for k, v in found.items() if k not in EXPECTED_DRIFT}
    assert not unexpected, "documented log events the code does not log as said:\n" + "\n".join(
        f"  {k}: {v}" for k, v in sorted(unexpected.items()))
    stale = set(EXPECTED_DRIFT) - set(found)
    assert not stale, f"EXPECTED_DRIFT entries no longer found (remove them): {sorted(stale)}"


def test_extraction_finds_the_documented_events() -> None:
    """A reshaped README or runbook must not silently empty the check (72 events when written)."""
    documented = _the_docs()
    events = {m.event for m in documented}
    assert len(events) > 60, f"only {len(events)} documented events found: {sorted(events)}"
    assert {"reconcile_timed_out", "job_given_back", "job_interruptions_exhausted", "sweep_slow",
            "transaction_pooler", "database_lock_wait", "mark_connection_lost", "soak_offset_jump"} <= events
    assert sum(bool(m.fields) for m in documented) > 30
    assert sum(bool(m.level) for m in documented) > 8
    assert {m.where.split(":")[0] for m in documented} >= {"README.md", "alerts.yml"}
    assert sum(m.where.startswith("deploy/runbooks/") for m in documented) > 40
    assert len(_the_code()) > 150


CODE = """
class Watch:
    lock_event = "known_lock"
def f(log, event):
    log.warning("known_event", step=1, **extra(2))
    log.info(self.lock_event, pid=1)
    which = "known_a" if log else "known_b"
    log.error(which)
    log.info(event)
    say = log.warning if log else log.debug
    say("known_alias", rounds=1)
def extra(x):
    return {"waited_s": x}
f(None, event="known_by_keyword")
"""


def test_the_checker_catches_an_invented_event_level_and_field() -> None:
    emitted = emitted_events({"m.py": ast.parse(CODE), "other.py": ast.parse('which = "elsewhere"')})
    assert set(emitted) == {"known_event", "known_lock", "known_a", "known_b", "known_by_keyword", "known_alias"}
    assert {c[0] for c in emitted["known_alias"].calls} == {"warning", "debug"}
    docs = {"doc": "Logs: `known_event` (warning: `step`, `waited_s`), `known_lock`, `known_a`. "
                   "Also `known_b` (an error) and a metric: logs `outbox_relay_database_up`.\n\n"
                   "Logs `known_alias`: `rounds`, `invented_alias_field`.\n\n"
                   "PostgreSQL logs `unique_violation`; `known_by_keyword` is logged. Logs "
                   "`invented_event`, and `known_event` (info: `invented_field`).",
            "alerts.yml:A": "Logs: known_lock (pid), invented_bare or known_a."}
    found = problems(documented_events(docs), emitted)
    assert set(found) == {"invented_event", "invented_bare", "known_event", "known_event.invented_field",
                          "known_alias.invented_alias_field"}, found
    assert "logged at ['warning']" in found["known_event"]
    prose = {"doc": "The watch says so once (`known_evnt`), with `known_reason` and `known_alias`."}
    assert near_misses(prose, emitted, {"known_reason"}) == {
        "known_evnt": "doc: not in the code; the code logs 'known_event'"}
    assert field_list("once, then every 30 s") == (None, ())
    assert field_list("warning: `a`, the b name; `c_d`, masked") == ("warning", ("a", "c_d"))
