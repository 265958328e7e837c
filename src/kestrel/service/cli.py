"""`kestrel serve`, `kestrel config check`, `kestrel journal dump`, `check`, `convert` and `recover`:
the command line."""

from __future__ import annotations

import sys

from kestrel.service import start_signals

if sys.argv[1:2] == ["serve"]:  # before the imports below, a third of a second
    start_signals.install()

from importlib import metadata  # noqa: E402

from gevent import monkey  # noqa: E402


def patch_all() -> None:
    """gevent's patch_all looks up its plugins' entry points at each of its 25 steps, reading every
    installed distribution's metadata each time: a fifth of a server's start. The same entry
    points, read once."""
    scan = metadata.entry_points
    found = scan()
    metadata.entry_points = found.select
    try:
        monkey.patch_all()
    finally:
        metadata.entry_points = scan


patch_all()

import argparse  # noqa: E402
import os  # noqa: E402
import textwrap  # noqa: E402

from kestrel import SERVER_VERSION  # noqa: E402
from kestrel.service.config import EXAMPLE, ServerConfig, each_error, load, with_overrides  # noqa: E402
from kestrel.service.logs import LOG_FORMATS, configure_logging  # noqa: E402
from kestrel.service.session.status import status_file_problem  # noqa: E402
from kestrel.service.startup import (  # noqa: E402
    EXIT_CODES,
    EXIT_CONFIG,
    EXIT_DAMAGED_JOURNAL,
    StartupError,
    describe,
)
from kestrel.storage import formats  # noqa: E402
from kestrel.storage.errors import ConfigError, CorruptJournalError  # noqa: E402
from kestrel.storage.tools import check as journal_check  # noqa: E402
from kestrel.storage.tools import convert as journal_convert  # noqa: E402
from kestrel.storage.tools import dump as journal_dump  # noqa: E402
from kestrel.storage.tools import recover as journal_recover  # noqa: E402

SERVE_DESCRIPTION = """\
Serve the queues: Kestrel's Thrift service, its memcache and text protocols, and an admin HTTP port
(/ping, /ready, /stats.json, /stats.txt, /metrics). Settings come from the YAML config file (`kestrel
config example` writes one listing every key with its default); the options below override it.
SIGTERM or SIGINT stop the server cleanly (while it loads its queues, at once: nothing is lost;
a second one closes the connections still busy without waiting for shutdown_timeout);
SIGHUP reloads the queue and alias settings (logging each queue it changes, and the keys only a
restart applies; a bad or emptied file is refused and the settings kept). A failure to start is one
line on stderr naming what failed, where and why, and the exit code says which kind it is."""


def exit_codes_epilog() -> str:
    lines = ["exit codes:"]
    for code, meaning in EXIT_CODES:
        lines += textwrap.wrap(meaning, 100, initial_indent=f"  {code}  ", subsequent_indent="     ")
    return "\n".join(lines)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description and the exit codes as written; the options' help wrapped as usual."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=110)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server's options. Those naming a setting default to the config file's value, else the
    built-in default shown."""
    d = ServerConfig()
    p.add_argument("--config", metavar="FILE",
                   help="YAML config file (default: none, the built-in defaults; `kestrel config example` "
                        "writes one with every key)")
    p.add_argument("--check", action="store_true",
                   help="check the configuration (file and options) and exit: 0 if good, 2 if not")
    p.add_argument("--queue-path", metavar="DIR", help=f"directory of the journals (default: {d.queue_path})")
    p.add_argument("--listen-address", metavar="ADDR",
                   help=f"address the listeners bind to (default: {d.listen_address})")
    for name in ("thrift", "memcache", "text", "admin"):
        port = getattr(d, f"{name}_port")
        p.add_argument(f"--{name}-port", type=int, metavar="N",
                       help=f"{name} port, 0 disables it (default: {port})")
    p.add_argument("--salvage", action="store_true", default=None,
                   help="serve a damaged queue, setting aside only what does not verify (a copy kept "
                        "in .kestrel/aside/), instead of refusing it (default: off)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe log lines written (default: info)")
    p.add_argument("--log-format", default="auto", choices=LOG_FORMATS,
                   help="JSON lines, or readable console lines; auto: console on a terminal, JSON "
                        "otherwise (default: auto)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kestrel", description="A durable Kestrel queue server. Without a command, `kestrel` serves.",
        epilog=exit_codes_epilog(), formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"kestrel {SERVER_VERSION}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="serve the queues (the default)", description=SERVE_DESCRIPTION,
                           epilog=exit_codes_epilog(), formatter_class=_HelpFormatter)
    for p in (parser, serve):
        add_serve_arguments(p)
    # An option `serve` is not given keeps the value given before it: argparse's subcommand sets
    # its own defaults over them (`kestrel --config k.yaml serve` served the built-in defaults).
    for action in serve._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    config = sub.add_parser("config", help="check a config file without starting, or write the example")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check", help="check a config file; exit 0 if good, 2 listing every bad key if not",
        description="Check a config file as `kestrel serve` would read it, without starting: exit 0 "
                    "if it is good, 2 with one line per bad key if not.")
    check.add_argument("file", metavar="FILE", help="the YAML config file")
    example = config_sub.add_parser(
        "example", help="write the example config file: every key, its default and what it does",
        description="Write the example config file (every key with its default and a comment; queue_path "
                    "is the systemd unit's /var/spool/kestrel) to FILE, or to standard output (no FILE, "
                    "or -). An existing FILE is left alone (exit 1).")
    example.add_argument("file", metavar="FILE", nargs="?",
                         help="where to write it (default, or -: standard output)")
    journal = sub.add_parser("journal", help="offline tools for journal files")
    journal_sub = journal.add_subparsers(dest="journal_command", required=True)
    journal_dump.add_arguments(journal_sub.add_parser(
        "dump", help="print the records of journal files of either format (Kestrel 2 or 3)"))
    journal_check.add_arguments(journal_sub.add_parser(
        "check", help="what a start-up would find damaged and --salvage would set aside; changes nothing"))
    journal_convert.add_arguments(journal_sub.add_parser(
        "convert", help="convert queues to the other journal format, offline (the server must be stopped)"))
    journal_recover.add_arguments(journal_sub.add_parser(
        "recover", help="put what a commit log left by a crash holds into the journals, offline"))
    return parser


def report_config_error(error: ConfigError) -> int:
    """One line per bad key on stderr; the exit code of a bad configuration."""
    for each in each_error(error):
        print(f"kestrel: bad configuration: {each}", file=sys.stderr)
    return EXIT_CONFIG


def _format_refusals(config: ServerConfig) -> list[ConfigError]:
    """What a start would refuse of the queues on disk: those whose files are in the other format
    than their `journal_format` (none while the queue path is not there yet). A queue a start refuses
    alone (`formats.refused_before_load`: files in both formats, say) is no setting's fault. A path
    that is a file, or under one, is refused as the start refuses it."""
    try:
        on_disk = formats.queues_on_disk(config.queue_path,
                                         lambda name: config.queues.for_queue(name).journal_format)
        refused = formats.refused_on_disk(config.queue_path)
    except NotADirectoryError as e:
        return [ConfigError("queue_path", describe(e, "queue path", config.queue_path))]
    except OSError:
        return []  # the start says what is wrong with the path, for the user it runs as
    return [formats.format_refusal(config.queue_path, name, found, wanted)
            for name, found in sorted(on_disk.items())
            if name not in refused and found != (wanted := config.queues.for_queue(name).journal_format)]


def _status_file_refusal(config: ServerConfig) -> list[ConfigError]:
    """The status file a start would refuse for what is there now (`status_file_problem`)."""
    status_file = config.resolved_status_file()
    problem = None if status_file is None else status_file_problem(status_file, config.queue_path)
    if problem is None or status_file is None:
        return []
    return [ConfigError("status_file", describe(problem, "status file", status_file))]


def read_config(args: argparse.Namespace) -> ServerConfig:
    """The config file with the command line's values laid over it; raises ConfigError."""
    return with_overrides(load(args.config), queue_path=args.queue_path, listen_address=args.listen_address,
                          thrift_port=args.thrift_port, memcache_port=args.memcache_port,
                          text_port=args.text_port, admin_port=args.admin_port, salvage=args.salvage)


def write_example(path: str | None) -> int:
    """The example config to `path` (a new file; its directory made if missing) or to stdout (no
    path, or `-`)."""
    text = EXAMPLE.read_text(encoding="utf-8")
    if path is None or path == "-":
        sys.stdout.write(text)
        return 0
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "x", encoding="utf-8") as out:
            out.write(text)
    except OSError as e:
        print(f"kestrel: cannot write {path}: {e.strerror}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "journal" and args.journal_command == "dump":
        return journal_dump.run(args)
    if args.command == "journal" and args.journal_command == "check":
        return journal_check.run(args)
    if args.command == "journal" and args.journal_command == "convert":
        return journal_convert.run(args)
    if args.command == "journal" and args.journal_command == "recover":
        return journal_recover.run(args)
    if args.command == "config" and args.config_command == "example":
        return write_example(args.file)
    if args.command == "config":
        try:
            load(args.file)
        except ConfigError as e:
            return report_config_error(e)
        print(f"{args.file}: ok")
        return 0
    try:
        config = read_config(args)
    except ConfigError as e:
        return report_config_error(e)
    if args.check:
        refused = _format_refusals(config) + _status_file_refusal(config)
        for error in refused:
            report_config_error(error)
        if refused:
            return EXIT_CONFIG
        print(f"{args.config or '(built-in defaults)'}: ok")
        return 0
    configure_logging(args.log_level, args.log_format)
    from kestrel.service.app import App

    try:
        App(config).run()
    except ConfigError as e:  # queue files in another journal format than configured
        return report_config_error(e)
    except CorruptJournalError as e:
        # Damage no one queue owns (a conversion's record): --salvage does not apply.
        print(f"kestrel: cannot start: {e.path}: {e.reason}: {formats.INTENT_REMEDY}", file=sys.stderr)
        return EXIT_DAMAGED_JOURNAL
    except StartupError as e:
        print(f"kestrel: cannot start: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
