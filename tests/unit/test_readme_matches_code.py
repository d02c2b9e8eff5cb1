"""README.md is the contract operators and service teams read: its options table, metric
names, variables, `make` targets, ``python -m`` modules, commands and SDK defaults are held
to the parsers, settings, registries and Makefile, without a server (test_deploy.py does
this for deploy/; the names both hold to are in tests/fixtures/deploy_names.py).  README
drift waits in EXPECTED_DRIFT."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any, NamedTuple

from consumer_sdk.config import InboxConfig
from consumer_sdk.jobs import cli as jobs_cli
from consumer_sdk.jobs.config import WorkerConfig
from outbox_embedded import cli as embedded_cli
from relay import cli as relay_cli
from relay.config import Settings, build_settings, default_owner, mark_connections
from relay.config_env import env_values, unknown_env_variables
from relay.errors import ConfigError
from relay.options import DEFAULT_LEASE_DURATION_S, DEFAULT_MARK_CONNECTIONS, OPTIONS
from tests.fixtures.deploy_names import (
    METRICS_CLASSES,
    command_problems,
    exported_metric_names,
    is_relay_env,
    quoted_commands,
    subcommands,
)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
MIGRATIONS = ROOT / "outbox_core" / "sql" / "migrations"
DSN = "postgresql://relay@db.invalid/app"  # parsed, never connected to

#: The header of the relay's options table in "## Configuration".
OPTIONS_HEADER = "| flag | environment | default | |"

REQUIRED = object()  # a default the README gives as "—": the command refuses to start without it

#: Defaults the README words in prose, with the code value the words stand for (checked).
PROSE_DEFAULTS: dict[str, tuple[str, Any]] = {
    "dsn": ("—", REQUIRED),
    "bootstrap_servers": ("—", REQUIRED),  # required by `run` (or bootstrap.servers)
    "owner": ("host-pid", default_owner()),  # relay.config.default_owner
    "shards": ("database's", None),  # None: run reads the count migrate --shards stored
    "heartbeat_interval_s": ("lease / 3", DEFAULT_LEASE_DURATION_S / 3),
    "dead_letter_topic": ("none", None),
    "cleanup_retention_s": ("off", None),
    "console_token": ("—", None),  # needed only with --console-actions
    # 0 asks relay.config.mark_connections() for the automatic count (checked below).
    "mark_connections": (f"0 (automatic: {DEFAULT_MARK_CONNECTIONS})", 0),
}

#: Options of the code that the table may leave out on purpose (none today).
HIDDEN_OPTIONS: set[str] = set()

#: Flags of a command's own (no variable, so not in the table): the README must still name
#: each somewhere.  --help and --version are argparse's.
ARGPARSE_FLAGS = {"--help", "--version"}

#: Config classes whose keyword arguments the README quotes as `Class(name=...)`.
SDK_CONFIGS = {"InboxConfig": InboxConfig, "WorkerConfig": WorkerConfig}

#: Mismatches the README must mend (wording in the report of session s43, helper h1):
#: name -> the problem exactly as found.  Empty it as the README is fixed: an entry no
#: longer found fails too, so the list cannot go stale.
EXPECTED_DRIFT: dict[str, str] = {}


def fenced_commands(text: str) -> list[str]:
    """The logical lines of fenced blocks: backslash continuations joined, # comments cut."""
    lines: list[str] = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        joined = re.sub(r"\\\n", " ", block)
        lines += [re.sub(r"\s+#.*", "", line).strip() for line in joined.splitlines()]
    return [line for line in lines if line]


def code_spans(text: str) -> list[str]:
    """Inline `code spans` outside fenced blocks, line breaks inside them read as spaces."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)  # fences dropped
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]


def snippets(text: str) -> list[str]:
    """Everything the README gives as code, with local paths to the tools dropped:
    `.venv/bin/outbox-relay` is `outbox-relay`, `.venv/bin/python` is `python`."""
    found = code_spans(text) + fenced_commands(text)
    return [re.sub(r"(?:\S*/)?(outbox-relay|python3?)\b", r"\1", s) for s in found]


class OptionRow(NamedTuple):
    flag: str
    commands: tuple[str, ...]  # "(migrate)" after the flag; `run` when none is named
    env: str
    mentions_file: bool  # "(or `..._TOKEN_FILE`)"
    default: str


def option_rows(text: str) -> list[OptionRow]:
    """The rows of the options table: `| `--flag` (command) | `VARIABLE` | default | help |`."""
    rows: list[OptionRow] = []
    lines = text.splitlines()
    start = lines.index(OPTIONS_HEADER) + 2  # past the header and its |---| line
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        flag_cell, env_cell, default_cell, _help = line.strip("|").split("|", 3)
        annotation = re.search(r"\(([a-z, -]+)\)", flag_cell)  # "(migrate)" or "(console)"
        rows.append(OptionRow(
            flag=re.findall(r"`([^`]+)`", flag_cell)[0],
            commands=tuple(annotation.group(1).split(", ")) if annotation else ("run",),
            env=re.findall(r"`([^`]+)`", env_cell)[0],
            mentions_file="_FILE" in env_cell,
            default=default_cell.strip()))
    return rows


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser; `dead-letters` by its `list` action (they share the options)."""
    parsers = subcommands(relay_cli.build_parser())
    parsers["dead-letters"] = subcommands(parsers["dead-letters"])["list"]
    return parsers


def every_flag(parser: argparse.ArgumentParser) -> set[str]:
    """The --flags of a parser and of all its sub-commands."""
    flags = {f for f in parser._option_string_actions if f.startswith("--")}
    return flags.union(*(every_flag(sub) for sub in subcommands(parser).values()))


def effective_default(name: str) -> Any:
    """What the relay runs with when the option is not given (not only what --help says):
    REQUIRED when the settings are refused without it (the DSN, and the broker for run)."""
    values, broker = ({}, False) if name == "dsn" else ({"dsn": DSN}, name == "bootstrap_servers")
    try:
        return getattr(build_settings(values, require_broker=broker), name)
    except ConfigError:
        return REQUIRED


def default_problem(row: OptionRow, name: str) -> str | None:
    """Whether the README's default is what the relay does and what --help says."""
    option = next(o for o in OPTIONS if o.name == name)
    actual = effective_default(name)
    if name in PROSE_DEFAULTS:
        words, meant = PROSE_DEFAULTS[name]
        if row.default != words or actual != meant:
            return (f"{row.flag}: README default {row.default!r}, expected {words!r} "
                    f"standing for {meant!r}; the relay runs with {actual!r}")
        if name == "mark_connections" and mark_connections(Settings(dsn=DSN)) != DEFAULT_MARK_CONNECTIONS:
            return f"{row.flag}: 0 no longer means {DEFAULT_MARK_CONNECTIONS} connection"
        return None
    try:
        stated = option.parse(row.default)
    except ValueError:
        return f"{row.flag}: README default {row.default!r} is no value the option takes"
    helped = option.parse(option.default) if isinstance(option.default, str) else option.default
    if stated != actual or stated != helped:
        return (f"{row.flag}: README default {row.default!r}, the relay runs with {actual!r}, "
                f"--help says {option.default!r}")
    return None


def option_problems(rows: list[OptionRow]) -> list[str]:
    """Each row against the parser, the environment mapping and the settings; then every
    option of the code against the rows."""
    parsers = command_parsers()
    problems: list[str] = []
    for row in rows:
        actions = [parsers[c]._option_string_actions.get(row.flag) if c in parsers else None
                   for c in row.commands]
        if None in actions:
            problems.append(f"{row.flag}: no such flag of `outbox-relay {'/'.join(row.commands)}`")
            continue
        name = actions[0].dest  # type: ignore[union-attr]
        if row.commands != ("run",) and row.flag in parsers["run"]._option_string_actions:
            problems.append(f"{row.flag}: README says {row.commands} only, `run` takes it too")
        if env_values({row.env: "x"}, row.commands[0]) != {name: "x"}:
            problems.append(f"{row.flag}: `{row.commands[0]}` does not read {row.env}")
        option = next((o for o in OPTIONS if o.name == name), None)
        if option is None:
            problems.append(f"{row.flag}: a command argument, not an option with a variable")
            continue
        if row.mentions_file and not option.secret:
            problems.append(f"{row.flag}: README names {row.env}_FILE, the relay reads no file")
        problems += filter(None, [default_problem(row, name)])
    tabled = {row.flag for row in rows}
    problems += [f"{o.flag}: an option of the relay the table leaves out" for o in OPTIONS
                 if o.flag not in tabled and o.name not in HIDDEN_OPTIONS]
    return problems


def command_argument_problems(text: str) -> list[str]:
    """Flags of a command's own (not options, so not in the table) the README never names."""
    own = every_flag(relay_cli.build_parser()) - {o.flag for o in OPTIONS} - ARGPARSE_FLAGS
    # A flag is named when it stands alone: `--view` is not named by `--view-s`.
    return [f"{flag}: a flag of outbox-relay the README never names" for flag in sorted(own)
            if not re.search(re.escape(flag) + r"(?![\w-])", text)]


#: A variable of the relay or the jobs CLI; one ending in "_" is a prefix (`OUTBOX_RELAY_KAFKA_<P>`).
ENV_VAR = re.compile(r"\bOUTBOX_(?:RELAY|JOBS)_[A-Z0-9_]*")
#: Variables the README names as mistakes the relay warns about ("is no option ... did you
#: mean"): checked to be unknown, and to get that hint.
MISSPELT_EXAMPLES = {"OUTBOX_RELAY_BATCHSIZE": "OUTBOX_RELAY_BATCH_SIZE"}


def jobs_cli_reads(name: str) -> bool:
    """Whether an option of the jobs CLI defaults to the variable (the DSN is read by main)."""
    parsers = [jobs_cli.build_parser({name: "readme-check"})]
    for parser in parsers:  # the list grows as it is walked: every sub-command's parser
        parsers += subcommands(parser).values()
    return name in (jobs_cli.ENV_DSN, jobs_cli.ENV_DSN_FILE) or any(
        action.default == "readme-check" for parser in parsers for action in parser._actions)


def env_problems(text: str) -> list[str]:
    """Variables the README names that nothing reads."""
    problems = []
    for name in sorted(set(ENV_VAR.findall(text))):
        if name.endswith("_"):
            continue
        if name in MISSPELT_EXAMPLES:
            if unknown_env_variables({name: "1"}) != [(name, MISSPELT_EXAMPLES[name])]:
                problems.append(f"{name}: the README's misspelt example gets no 'did you mean' hint")
        elif name.startswith("OUTBOX_RELAY_") and not is_relay_env(name):
            problems.append(f"{name}: the relay reads no such variable")
        elif name.startswith("OUTBOX_JOBS_") and not jobs_cli_reads(name):
            problems.append(f"{name}: python -m consumer_sdk.jobs reads no such variable")
    return problems


#: A metric name as prose writes it; a name ending in "_" is a prefix (`outbox_jobs_*`).
METRIC = re.compile(r"\boutbox_(?:relay|consumer|jobs)_[a-z0-9_]*")
#: `..._oldest_pending_age_seconds`: a name abbreviated after a full one of its family.
ABBREVIATED = re.compile(r"`\.\.\.(_[a-z0-9_]+)`")


def schema_names() -> set[str]:
    """Tables, functions and constraints the migrations create: prose names them too."""
    text = "\n".join(p.read_text() for p in MIGRATIONS.glob("*.sql"))
    return set(METRIC.findall(text))


def metric_names() -> set[str]:
    """Names a reader may query: every sample name, and the family name of a histogram or a
    summary (how prose names one); a counter is named with its _total."""
    names = exported_metric_names()
    for metrics in METRICS_CLASSES:
        names |= {f.name for f in metrics().registry.collect() if f.type in ("histogram", "summary")}
    return names


def metrics_in(text: str) -> set[str]:
    """Full metric names, and abbreviations expanded with the family of the name before."""
    found: set[str] = set()
    last_family = ""
    for match in re.finditer(f"{METRIC.pattern}|{ABBREVIATED.pattern}", text):
        if match.group(0).startswith("`..."):
            found.add(last_family + match.group(1)[1:])
            continue
        found.add(match.group(0))
        last_family = re.match(r"outbox_[a-z]+_", match.group(0)).group(0)  # type: ignore[union-attr]
    return found


def metric_problems(text: str) -> list[str]:
    known, schema = metric_names(), schema_names()
    problems = []
    for name in sorted(metrics_in(text) - known - schema):
        if name.endswith("_"):  # a prefix: `outbox_jobs_*`
            if not any(k.startswith(name) for k in known):
                problems.append(f"metric prefix {name}*: no metric starts with it")
        elif name + "_total" in known:
            problems.append(f"metric {name}: a counter, exported as {name}_total")
        else:
            problems.append(f"metric {name}: neither the relay nor the SDK exports it")
    return problems


def make_targets() -> set[str]:
    """Targets the Makefile defines: `name:` at a line's start (not `NAME := value`)."""
    return set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", MAKEFILE.read_text(), flags=re.MULTILINE))


def quoted_make_targets(found: list[str]) -> set[str]:
    """The target of each snippet that runs make, after any VARIABLE=value words."""
    commands = [[w for w in snippet.split() if "=" not in w] for snippet in found]  # no VAR=x
    return {words[1] for words in commands if words[:1] == ["make"] and len(words) > 1}


def module_problems(found: list[str]) -> list[str]:
    modules = {m for s in found for m in re.findall(r"\bpython3? -m ([\w.]+)", s)}
    return [f"python -m {m}: no such module" for m in sorted(modules)
            if importlib.util.find_spec(m) is None]


def cli_problems(found: list[str]) -> list[str]:
    """Commands and --options of quoted invocations; `demo` and `bench` parse their own."""
    problems = []
    for snippet in found:
        for cli, args in quoted_commands(f"`{snippet}`"):
            if cli == "outbox-relay" and args[0] in relay_cli.EMBEDDED_COMMANDS:
                known = embedded_cli.build_parser(args[0])._option_string_actions
                problems += [f"{cli} {' '.join(args)}: unknown option {word}" for word in args
                             if word.startswith("--") and word.split("=")[0] not in known]
                continue
            problems += command_problems(cli, args)
    return problems


def sdk_config_problems(found: list[str]) -> list[str]:
    """Keyword arguments of `InboxConfig(name=...)` and `WorkerConfig(name=)` spans."""
    calls = [call for s in found for call in re.findall(r"\b(\w+Config)\(([^)]*)\)", s)]
    return [f"{cls}({name}=): no such field" for cls, args in calls if cls in SDK_CONFIGS
            for name in re.findall(r"(\w+)=", args)  # the keywords of the call
            if name not in inspect.signature(SDK_CONFIGS[cls]).parameters]


def all_problems(text: str) -> list[str]:
    found = snippets(text)
    problems = option_problems(option_rows(text)) + command_argument_problems(text)
    problems += env_problems(text) + metric_problems(text)
    problems += [f"make {t}: no such target" for t in sorted(quoted_make_targets(found) - make_targets())]
    problems += module_problems(found) + cli_problems(found) + sdk_config_problems(found)
    return problems


def test_readme_matches_the_code() -> None:
    found = set(all_problems(README.read_text()))
    unexpected = sorted(found - set(EXPECTED_DRIFT.values()))
    mended = sorted(name for name, problem in EXPECTED_DRIFT.items() if problem not in found)
    assert not unexpected, "README.md and the code disagree:\n" + "\n".join(unexpected)
    assert not mended, f"EXPECTED_DRIFT entries the README no longer has, remove them: {mended}"


def test_the_readme_quotes_what_is_checked() -> None:
    """Each check reads something: a README reshaped past the parsers fails here, not silently."""
    text = README.read_text()
    found = snippets(text)
    assert len(option_rows(text)) >= 30
    assert len(metrics_in(text)) >= 30
    assert len(set(ENV_VAR.findall(text))) >= 40
    assert {"test", "demo", "lint"} <= quoted_make_targets(found)
    assert any("python -m consumer_sdk.jobs" in s for s in found)
    assert {cli for s in found for cli, _ in quoted_commands(f"`{s}`")} == {
        "outbox-relay", "python -m consumer_sdk.jobs"}
    assert any(re.search(r"\bWorkerConfig\(\w+=", s) for s in found)


def test_checks_catch_inventions() -> None:
    batch = OptionRow("--batch-size", ("run",), "OUTBOX_RELAY_BATCH_SIZE", False, "1000")
    assert option_problems([batch]) == [p for p in option_problems([batch]) if "leaves out" in p]
    for invented in (batch._replace(flag="--batch-rows"), batch._replace(env="OUTBOX_RELAY_BATCH"),
                     batch._replace(default="500"), batch._replace(commands=("migrate",)),
                     batch._replace(mentions_file=True)):
        assert len(option_problems([invented])) > len(option_problems([batch])), invented
    assert any("--exactly-once:" in p for p in option_problems([batch]))  # the reverse check
    assert "--view: a flag of outbox-relay the README never names" in command_argument_problems(
        "`--print` `--view-s`")
    assert env_problems("OUTBOX_RELAY_KAFKA_<P> OUTBOX_RELAY_DSN_FILE OUTBOX_JOBS_OLDER_THAN_DAYS") == []
    assert len(env_problems("OUTBOX_RELAY_BATCH_ROWS OUTBOX_JOBS_OLDER_THAN")) == 2
    assert metric_problems("`outbox_relay_pending_rows`, `..._oldest_pending_age_seconds`") == []
    assert metric_problems("`outbox_relay_pending_rows`, `..._oldest_pending_age`")
    assert metric_problems("`outbox_relay_leases_lost`") == [
        "metric outbox_relay_leases_lost: a counter, exported as outbox_relay_leases_lost_total"]
    assert metric_problems("`outbox_relay_widgets_total` `outbox_relay_zzz_*`") == [
        "metric outbox_relay_widgets_total: neither the relay nor the SDK exports it",
        "metric prefix outbox_relay_zzz_*: no metric starts with it"]
    assert metric_problems("`outbox_relay_shards` `outbox_jobs_*`") == []  # a table, a prefix
    assert quoted_make_targets(["A=1 make tset PYTEST_ARGS=-q"]) - make_targets() == {"tset"}
    assert module_problems(["python -m outbox_embedded.bench_abc"])
    assert cli_problems(["outbox-relay dead-letters list|show"]) == []
    assert cli_problems(["outbox-relay replay --since 2h --frobnicate"])
    assert cli_problems(["outbox-relay bench --json b.json --runs 3"]) == []
    assert cli_problems(["outbox-relay bench --jsn b.json"])
    assert sdk_config_problems(["WorkerConfig(lease_s=1, spin=)"]) == ["WorkerConfig(spin=): no such field"]
    shards = OptionRow("--shards", ("run",), "OUTBOX_RELAY_SHARDS", False, "database's")
    assert default_problem(shards, "shards") is None  # a prose default, mapped
    assert default_problem(shards._replace(default="16"), "shards")
