"""Judging a torn tail: the one torn-tail rule (src/kestrel/storage/torn_tail.py) on a last file that
holds nothing but one torn record, beside a CRC-32 of the same bytes (one pass in C: the peer).

The record's data reads as records from place after place, each failing late, the worst for a rule
that looks for whole records inside a torn record (tests/storage/test_torn_tail.py lays out the
same): REMOVE opcodes in a Kestrel 2 journal; in a Kestrel 3 writer file and a commit log segment,
every 64 bytes the header of a record of a quarter of the data. For the log also the same headers
with fields that fit (`fitting`): every place's claimed body is checksummed, the bodies overlapping.
Also a megabyte of random bytes 0x00 to 0x09; and for the log a whole segment read
(`damaged`): records of 64 bytes of data, every other one's checksum damaged, each damaged span
judged and read on past. Each case runs in a process of its own, stopped after
`--limit` seconds; `--source` runs another tree's code (bench/README.md, "Comparing code").

    .venv/bin/python -m bench.bench_torn_tail [--megabytes 1 16] [--limit 120] [--source DIR]
        [--only kestrel2 kestrel3 'commit log']
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
import zlib

T0 = 1_700_000_000_000
CASES = ("kestrel2", "kestrel3", "commit log")


def torn_record(fmt: str, megabytes: int, kind: str) -> bytes:
    """One record of `megabytes` of data of `kind` (late, fitting, random), its last 1,000 bytes cut
    off; or a segment of `megabytes` with damaged records (`damaged`)."""
    from kestrel.storage import commit_log
    from kestrel.storage.kestrel2 import codec
    from kestrel.storage.kestrel3 import codec as codec3

    size = megabytes << 20
    if kind == "damaged":
        records = [bytearray(commit_log.encode_record("q", 0, n * 64, bytes(64))) for n in range(size // 88)]
        for record in records[1::2]:
            record[4] ^= 1  # its checksum
        return commit_log.MARK + b"".join(records) + bytes(1 << 16)
    if kind == "random":
        data = random.Random(7).randbytes(size).translate(bytes(n % 10 for n in range(256)))
    elif fmt == "kestrel2":
        data = bytes([codec.REMOVE]) * size
    else:
        if fmt == "kestrel3":
            block = bytes([0x86]) + struct.pack("<iiQq", size // 4, 0, 1, T0)
        else:
            kind_epoch = 0 if kind == "fitting" else 9 << 56  # a JOURNAL record, or no kind at all
            block = struct.pack("<IIH", size // 4, 0, 1) + b"q" + struct.pack("<QQ", kind_epoch, 0)
        data = (block + bytes(64 - len(block))) * (size // 64)
    if fmt == "kestrel2":
        whole = codec.encode_addx(T0, 0, data)
    elif fmt == "kestrel3":
        whole = codec3.encode(codec3.Put(4, 0, T0, None, data))
    else:
        whole = commit_log.encode_record("q", 0, 0, data)
    return whole[:-1000]


def judge_once(fmt: str, megabytes: int, kind: str) -> dict[str, object]:
    """The rule's answer for the torn record and its time (wall, CPU), and the peer's."""
    from kestrel.storage import commit_log, torn_tail
    from kestrel.storage.kestrel2 import codec
    from kestrel.storage.kestrel3.codec import FileKind, TailRecords

    choices: dict[str, torn_tail.Records] = {
        "kestrel2": codec.TAIL_RECORDS, "kestrel3": TailRecords(FileKind.WRITER),
        "commit log": commit_log.LogRecords()}
    records = choices[fmt]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "torn")
        with open(path, "wb") as f:
            f.write(torn_record(fmt, megabytes, kind))
        started = time.perf_counter()
        with open(path, "rb") as f:
            zlib.crc32(f.read())
        peer = time.perf_counter() - started
        started, cpu = time.perf_counter(), time.process_time()
        if kind == "damaged":
            segment = commit_log.read_segment(path, last=True)
        else:
            error = torn_tail.judge(path, 0, "an incomplete record", records, last=True)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    if kind == "damaged":
        decision = f"{len(segment.damage)} damaged spans, {len(segment.records)} records"
    else:
        decision = "torn: cut" if error is None else f"damage: {error.reason[:60]}"
    return {"wall": wall, "cpu": cpu, "peer": peer, "decision": decision}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--limit", type=float, default=120.0, help="seconds before a case is stopped")
    parser.add_argument("--source", help="a tree whose src/ (and build/compiled) to run instead")
    parser.add_argument("--only", nargs="+", choices=CASES, default=CASES, help="formats (all)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # fmt/megabytes/random: one case, here
    args = parser.parse_args()
    if args.case:
        fmt, megabytes, kind = args.case.split("/")
        print(json.dumps(judge_once(fmt, int(megabytes), kind)))
        return
    env = dict(os.environ)
    if args.source:
        paths = [os.path.join(args.source, "build", "compiled"), os.path.join(args.source, "src")]
        env["PYTHONPATH"] = os.pathsep.join(paths + [os.getcwd()])
    cases = [(fmt, mb, "late") for mb in args.megabytes for fmt in args.only]
    cases += [("commit log", mb, "fitting") for mb in args.megabytes if "commit log" in args.only]
    cases += [(fmt, 1, "random") for fmt in args.only]
    cases += [("commit log", mb, "damaged") for mb in args.megabytes if "commit log" in args.only]
    for fmt, megabytes, kind in cases:
        command = [sys.executable, "-m", "bench.bench_torn_tail", "--case", f"{fmt}/{megabytes}/{kind}"]
        try:
            out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.limit,
                                 check=True).stdout
        except subprocess.TimeoutExpired:
            print(f"{fmt:10} {megabytes:3} MB {kind:7}  stopped after {args.limit:.0f} s", flush=True)
            continue
        got = json.loads(out.strip().splitlines()[-1])
        print(f"{fmt:10} {megabytes:3} MB {kind:7}  rule {got['wall']:8.2f} s wall {got['cpu']:8.2f} s CPU"
              f"  peer CRC-32 {got['peer'] * 1000:7.1f} ms  ratio {got['wall'] / got['peer']:8.0f}"
              f"  {got['decision']}", flush=True)


if __name__ == "__main__":
    main()
