"""`kestrel serve`, `kestrel journal dump` and `kestrel journal convert`: the command line."""

from __future__ import annotations

from importlib import metadata

from gevent import monkey


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
import sys  # noqa: E402

from kestrel import SERVER_VERSION  # noqa: E402
from kestrel.service.config import load, with_overrides  # noqa: E402
from kestrel.service.logs import configure_logging  # noqa: E402
from kestrel.storage.errors import (  # noqa: E402
    ConfigError,
    CorruptJournalError,
    JournalWriteError,
    QueuePathInUse,
    TooManyQueues,
)
from kestrel.storage.tools import convert as journal_convert  # noqa: E402
from kestrel.storage.tools import dump as journal_dump  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kestrel", description="A durable Kestrel queue server.")
    parser.add_argument("--version", action="version", version=f"kestrel {SERVER_VERSION}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="serve the queues (the default)")
    for p in (parser, serve):
        p.add_argument("--config", metavar="FILE", help="YAML config file (see deploy/kestrel.yaml)")
        p.add_argument("--queue-path", metavar="DIR", help="directory of the journals")
        p.add_argument("--listen-address", metavar="ADDR", help="address the listeners bind to")
        for name in ("thrift", "memcache", "text", "admin"):
            p.add_argument(f"--{name}-port", type=int, metavar="N", help=f"{name} port (0 disables it)")
        p.add_argument("--salvage", action="store_true", default=None,
                       help="load what precedes a corrupt journal record instead of refusing to start")
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    journal = sub.add_parser("journal", help="offline tools for journal files")
    journal_sub = journal.add_subparsers(dest="journal_command", required=True)
    journal_dump.add_arguments(journal_sub.add_parser(
        "dump", help="print the records of journal files of either format (Kestrel 2 or 3)"))
    journal_convert.add_arguments(journal_sub.add_parser(
        "convert", help="convert queues to the other journal format, offline (the server must be stopped)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "journal" and args.journal_command == "dump":
        return journal_dump.run(args)
    if args.command == "journal" and args.journal_command == "convert":
        return journal_convert.run(args)
    configure_logging(args.log_level)
    from kestrel.service.app import App

    salvage = bool(args.salvage)
    try:
        config = with_overrides(load(args.config), queue_path=args.queue_path,
                                listen_address=args.listen_address, thrift_port=args.thrift_port,
                                memcache_port=args.memcache_port, text_port=args.text_port,
                                admin_port=args.admin_port, salvage=args.salvage)
        salvage = config.salvage
        os.makedirs(config.queue_path, exist_ok=True)
        App(config).run()
    except ConfigError as e:
        print(f"kestrel: bad configuration: {e}", file=sys.stderr)
        return 2
    except CorruptJournalError as e:
        advice = e.advice(salvage)
        print(f"kestrel: {e}" + (f"\n({advice})" if advice else ""), file=sys.stderr)
        return 3
    except (JournalWriteError, TooManyQueues, QueuePathInUse) as e:
        print(f"kestrel: cannot start: {e}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
