#!/usr/bin/env python3
"""Packs a fuzz corpus directory into one file, or unpacks it (the fuzzer reads directories;
the repository keeps each target's merged corpus as one file, corpus/<target>.pack, replayed by
tests/fuzz_corpus.rs). Format: for each input, its length as a little-endian u32, then its
bytes; inputs in name order.

  pack.py pack DIR FILE      # DIR's files into FILE
  pack.py unpack FILE DIR    # FILE's inputs into DIR (named by their SHA-1, as libFuzzer does)
"""
import hashlib
import os
import struct
import sys


def pack(src: str, dst: str) -> None:
    names = sorted(os.listdir(src))
    with open(dst, "wb") as out:
        for name in names:
            with open(os.path.join(src, name), "rb") as f:
                data = f.read()
            out.write(struct.pack("<I", len(data)))
            out.write(data)
    print(f"{dst}: {len(names)} inputs")


def unpack(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    with open(src, "rb") as f:
        blob = f.read()
    at, n = 0, 0
    while at < len(blob):
        (size,) = struct.unpack_from("<I", blob, at)
        data = blob[at + 4 : at + 4 + size]
        if len(data) != size:
            sys.exit(f"{src}: truncated at byte {at}")
        with open(os.path.join(dst, hashlib.sha1(data).hexdigest()), "wb") as f:
            f.write(data)
        at += 4 + size
        n += 1
    print(f"{dst}: {n} inputs")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        sys.exit(__doc__)
    (pack if sys.argv[1] == "pack" else unpack)(sys.argv[2], sys.argv[3])
