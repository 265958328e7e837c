"""Which journal format a queue's files are in, and finishing a conversion that a crash interrupted.

A conversion (`kestrel journal convert`, src/kestrel/storage/tools/convert.py) switches a queue to its
new format in one rename of `<queue_path>/.kestrel/convert`; whoever opens the queue path next
finishes the steps it names before anything else reads the files, so the live server needs this
module and never the converter."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kestrel.storage import filenames, layout, manifest
from kestrel.storage.config import JOURNAL_FORMATS
from kestrel.storage.disk import fsync_path, open_to_read, replace_file
from kestrel.storage.errors import (
    UNREADABLE_JSON,
    ConfigError,
    CorruptJournalError,
    InvalidQueueName,
    JournalFileShared,
    JournalFormatsMixed,
    NotAJournalFile,
)
from kestrel.storage.kestrel2 import codec as k2
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3.files import list_queue_files
from kestrel.storage.queue_path import JournalFiles, QueueDirectory, scan_queue_dir
from kestrel.storage.torn_tail import zeros_only

KESTREL2, KESTREL3 = JOURNAL_FORMATS


INTENT_NAME = os.path.join(filenames.OWN_DIRECTORY, filenames.CONVERT_NAME)  # in the queue path
# What to do with a conversion's record that cannot be read: a start stops on it (exit 3), since
# which of the queue's files are the new ones is in it.
INTENT_REMEDY = ("the record of a `kestrel journal convert` that stopped part way: restore it from a copy "
                 "and start again; without one, move it aside once `kestrel journal check` finds the "
                 "queue's files whole")


# Tests stop a conversion between two steps (a crash) by raising from here.
failpoint: Callable[[str], None] | None = None


def step(name: str) -> None:
    if failpoint is not None:
        failpoint(name)


def format_of(files: JournalFiles, configured: str | None = None) -> str:
    """The format of files a Kestrel 2 scan found for one name: Kestrel 3 writer journals (`q.<n>`)
    look like rotated Kestrel 2 journals by name, and are told apart by their header. A lone writer
    file whose header never reached the disk (`k3.unfinished_header`: empty, or its first bytes) could
    be either: it is taken to be in the `configured` format, or else in Kestrel 3's."""
    if files.live is None and not files.packs and files.rotated:
        header = first_bytes(files.rotated[0][1])[:k3.MAGIC_SIZE]
        if k3.kind_of(header) is not None:
            return KESTREL3
        if k3.unfinished_header(header):
            return configured or KESTREL3
    return KESTREL2


# What a file's first bytes say of it (`said_by`): Kestrel 2's or 3's, either's, or neither's.
EITHER, NEITHER = "either", "neither"
SHOWN_BYTES = 16  # the first bytes read of a file: a header, and what a refusal shows of a stray file


def first_bytes(path: str) -> bytes:
    """The first `SHOWN_BYTES` of a file of the queue path (fewer in a shorter file): the one read of
    a file's start that tells its format. Raises FileNotFoundError when it is gone."""
    with open_to_read(path) as f:
        return f.read(SHOWN_BYTES)


def said_by(head: bytes) -> str:
    """The format a journal file's first bytes say it is in: KESTREL3 by a Kestrel 3 header, KESTREL2
    by an opcode (a Kestrel 2 journal begins with a record), EITHER for nothing, the start of a
    writer header a crash cut or a power cut's zeros, NEITHER for anything else: a stray file named
    like a journal (`core`, `README`), which no format's loader or converter reads."""
    header = head[:k3.MAGIC_SIZE]
    if k3.kind_of(header) is not None:
        return KESTREL3
    if k3.unfinished_header(header) or zeros_only(header):
        return EITHER
    return KESTREL2 if header[0] <= k2.MAX_OPCODE else NEITHER


def queues_on_disk(queue_path: str, configured: Callable[[str], str] | None = None) -> dict[str, str]:
    """Every queue a start loads from the path, with the format it loads it in (Kestrel 2 names
    include `parent+child`): the queues and the rule of `QueueCollection.load`, so that the tools
    and the server cannot disagree. A queue is its journals or writer files, its format theirs
    (`format_of`); a reader checkpoint decides neither (`stray_checkpoints`). `configured` gives a
    queue's `journal_format`, for files that could be in either."""
    return {name: format_of(files, configured(name) if configured else None)
            for name, files in scan_queue_dir(queue_path).queues.items()}


def load_order(name: str) -> tuple[bool, str]:
    """The order a start loads the queues on disk in: parents before their fanout children, by name."""
    return "+" in name, name


def shared_files(found: QueueDirectory) -> dict[str, JournalFileShared]:
    """The queues of a scan a start refuses because one of their files is the same file (same
    `st_dev` and `st_ino`) as a file of another queue: a symbolic or hard link in the queue path,
    through which both queues would append to one file. Every file a queue appends to or replays
    counts: Kestrel 2 journals (live, rotated, packed), Kestrel 3 writer files and, for a Kestrel 3
    queue, its readers' checkpoints (appended to between rewrites). The file stays with the queue
    whose name for it is no symbolic link, else with the first in `load_order`; each other queue
    naming it is refused, both files named. Files of one queue sharing with each other are not this
    rule's. One `lstat` a file (and a `stat` of a symbolic link's target)."""
    taken: dict[manifest.FileId, tuple[tuple[bool, bool, str], str, str]] = {}
    named: list[tuple[manifest.FileId, tuple[bool, bool, str], str, str]] = []
    for name, files in found.queues.items():
        paths = [*files.replay_order(), *(p for _, p in files.packs)]
        checkpoints = found.checkpoints.get(name)
        if checkpoints and format_of(files) == KESTREL3:  # a Kestrel 2 queue reads none of them
            paths += checkpoints
        for path in paths:
            try:
                st = os.lstat(path)
                link = stat.S_ISLNK(st.st_mode)
                if link:
                    st = os.stat(path)
            except FileNotFoundError:
                continue  # gone since the listing: no file to share
            rank, identity = (link, *load_order(name)), manifest.file_id(st)
            named.append((identity, rank, name, path))
            kept = taken.get(identity)
            if kept is None or rank < kept[0]:
                taken[identity] = (rank, name, path)
    refused: dict[str, JournalFileShared] = {}
    for identity, _rank, name, path in sorted(named, key=lambda n: n[1:]):
        _, owner, other = taken[identity]
        if owner != name and name not in refused:
            refused[name] = JournalFileShared(path, other, owner)
    return refused


def refused_by_content(files: JournalFiles) -> CorruptJournalError | None:
    """The refusal of a queue by what its files begin with (`said_by`), or None: a file in neither
    format (`NotAJournalFile`), whichever format the queue is configured in; else Kestrel 3 writer
    files (`q.<n>` with a writer header) beside a file only Kestrel 2 has (`q`, `q.<ts>.pack`, a
    `q.<n>` that begins with a record), a stray or copied file (`JournalFormatsMixed`). `format_of`
    would call such files one format by the first it looks at, and the command its refusal names
    would refuse them in turn. One read of a file's first bytes."""
    kestrel2: list[str] = []
    kestrel3: list[str] = []
    rotated = {path for _, path in files.rotated}
    for path in [*files.replay_order(), *(path for _, path in files.packs)]:
        try:
            head = first_bytes(path)
        except FileNotFoundError:
            continue  # gone since the listing (a tool beside a running server)
        said = said_by(head)
        if said == NEITHER:
            return NotAJournalFile(path, head)
        if path not in rotated:  # a live journal or a pack is Kestrel 2's by its name
            kestrel2.append(path)
        elif said != EITHER:
            (kestrel3 if said == KESTREL3 else kestrel2).append(path)
    return JournalFormatsMixed(kestrel2, kestrel3) if kestrel2 and kestrel3 else None


def refused_before_load(found: QueueDirectory) -> dict[str, CorruptJournalError]:
    """The queues of a scan a start refuses before loading any of their files: files shared with
    another queue (`shared_files`), a file in neither format or files in both (`refused_by_content`)."""
    refused: dict[str, CorruptJournalError] = {}
    for name, files in found.queues.items():
        refusal = refused_by_content(files)
        if refusal is not None:
            refused[name] = refusal
    return {**shared_files(found), **refused}


def refused_on_disk(queue_path: str) -> dict[str, CorruptJournalError]:
    """`refused_before_load` of the queue path as it stands, for the tools and `serve --check` (a
    start applies the rules to the scan it loads from)."""
    return refused_before_load(scan_queue_dir(queue_path))


def stray_checkpoints(queue_path: str, name: str) -> list[str]:
    """The Kestrel 3 reader checkpoints beside Kestrel 2 queue `name`'s journals: no start reads
    them (there is no writer file they could be a reader of)."""
    if "+" in name:  # a fanout child's readers would be its parent's
        return []
    return sorted(list_queue_files(queue_path, name).readers.values())


def ignored_names(on_disk: Mapping[str, object]) -> dict[str, str]:
    """The names of `on_disk` no queue can have, each with why: a start leaves their files as they
    are and loads none of them (`QueueCollection.load`), and the tools say so."""
    ignored = {}
    for name in on_disk:
        try:
            filenames.check_queue_name(name)
        except InvalidQueueName as invalid:
            ignored[name] = (f"its files are named after an invalid queue name ({invalid}); the server "
                             f"ignores them")
    return ignored


def check_format(queue_path: str, name: str, files: JournalFiles, configured: str) -> None:
    """Refuse to load a queue whose files are in the other format than its `journal_format`.

    Raises ConfigError naming the convert command.
    """
    on_disk = format_of(files, configured)
    if on_disk != configured:
        raise format_refusal(queue_path, name, on_disk, configured)


def format_refusal(queue_path: str, name: str, on_disk: str, configured: str) -> ConfigError:
    """Queue `name`'s files are in format `on_disk`, its setting says `configured`: at a start, or
    at a reload (a live queue keeps its files' format, and the next start would refuse it)."""
    unit = name.partition("+")[0]
    return ConfigError(f"queues.{name}.journal_format",
                       f"queue {name!r} has {format_title(on_disk)} journal files in {queue_path} but its "
                       f"journal_format is {configured}: convert them with `kestrel journal convert "
                       f"--to {configured} {queue_path} {unit}`, or set journal_format: {on_disk}")


def format_title(fmt: str) -> str:
    return "Kestrel 3" if fmt == KESTREL3 else "Kestrel 2"


@dataclass
class Intent:
    """The steps after the switch: temporaries to rename into place, old files to delete."""

    to: str
    queue: str
    renames: list[tuple[str, str]] = field(default_factory=list)  # file names in the queue path
    deletes: list[str] = field(default_factory=list)


def write_intent(queue_path: str, intent: Intent) -> None:
    """Put `.kestrel/convert` in place in one rename (the switch), fsynced with its directory."""
    temporary = os.path.join(layout.ensure(queue_path), filenames.CONVERT_NAME + filenames.TEMPORARY_MARK)
    body = json.dumps({"to": intent.to, "queue": intent.queue, "renames": intent.renames,
                       "deletes": intent.deletes}).encode()
    replace_file(os.path.join(queue_path, INTENT_NAME), body, temporary)


def _read_intent(path: str) -> Intent:
    try:
        with open_to_read(path) as f:
            raw = json.loads(f.read())
        renames = [(str(a), str(b)) for a, b in raw["renames"]]
        intent = Intent(str(raw["to"]), str(raw["queue"]), renames, [str(d) for d in raw["deletes"]])
    except UNREADABLE_JSON as e:
        raise CorruptJournalError(path, 0, None, f"unreadable conversion record: {e}") from None
    for name in [n for pair in intent.renames for n in pair] + intent.deletes:
        if not _is_file_name(name):
            raise CorruptJournalError(path, 0, None, f"conversion record names {name!r}, not a file name")
    return intent


def _is_file_name(name: str) -> bool:
    """A file of the queue path, or of the server's own directory in it (a manifest)."""
    parts = name.split(os.sep)
    if len(parts) == 2 and parts[0] == filenames.OWN_DIRECTORY:
        parts = parts[1:]
    return len(parts) == 1 and parts[0] not in ("", ".", "..")


def finish_intent(queue_path: str, intent: Intent) -> None:
    """Rename the new files into place, delete the old ones, then drop `.kestrel/convert`.
    Idempotent: it may run again after a crash part way through."""
    own = filenames.own_path(queue_path)
    for temporary, final in intent.renames:
        source = os.path.join(queue_path, temporary)
        if os.path.exists(source):
            os.replace(source, os.path.join(queue_path, final))
            step("renamed")
    fsync_path(queue_path)
    fsync_path(own)
    for name in intent.deletes:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(queue_path, name))
            step("deleted")
    fsync_path(queue_path)
    fsync_path(own)
    step("finished")
    os.unlink(os.path.join(queue_path, INTENT_NAME))
    fsync_path(own)


def finish_interrupted(queue_path: str) -> str | None:
    """Complete a conversion that stopped after its switch; the queue it converted, if any.

    Called before anything else reads the queue path (start-up deletes temporaries, and some of
    them may be the new files). Raises CorruptJournalError when `.kestrel/convert` cannot be read.
    """
    intent = interrupted_conversion(queue_path)
    if intent is None:
        return None
    finish_intent(queue_path, intent)
    return intent.queue


def interrupted_conversion(queue_path: str) -> Intent | None:
    """The record of a conversion that stopped after its switch, which the next start completes
    (`finish_interrupted`), if there is one. Raises CorruptJournalError when it cannot be read."""
    path = os.path.join(queue_path, INTENT_NAME)
    return _read_intent(path) if os.path.exists(path) else None
