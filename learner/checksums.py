"""Checksums of a saved step: the size and SHA-256 of each of its files, written last, verified.

    write_checksums(step_dir)          # once every file of the step is written
    problem = verify_checksums(step_dir)   # None, or what is wrong ("state/d/0a1b: 12 bytes; ...")

`checksums.json` in the step directory lists every other file under it; it is written atomically
after them, so a step without one did not finish. learner/checkpoint.py writes and checks them.
"""

from __future__ import annotations

import hashlib
import json
import os

CHECKSUMS = "checksums.json"  # in each step directory: {"files": {relative path: [bytes, sha256]}}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: str) -> list[str]:
    """Every file under `step_dir` (relative, "/"-separated), the checksums file excepted."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir).replace(os.sep, "/")
            if rel != CHECKSUMS:
                out.append(rel)
    return sorted(out)


def write_checksums(step_dir: str) -> None:
    """Writes `step_dir/checksums.json`: size and SHA-256 of each file (atomically, last)."""
    files = {}
    for rel in _files(step_dir):
        path = os.path.join(step_dir, rel)
        files[rel] = [os.path.getsize(path), _sha256(path)]
    tmp = os.path.join(step_dir, CHECKSUMS + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, CHECKSUMS))


def verify_checksums(step_dir: str) -> str | None:
    """What is wrong with a saved step ("state/d/0a1b: 12 bytes; expected 209"), or None if intact."""
    manifest = os.path.join(step_dir, CHECKSUMS)
    if not os.path.isfile(manifest):
        return f"{CHECKSUMS} is missing (its save did not finish)"
    try:
        with open(manifest, encoding="utf-8") as f:
            files = json.load(f)["files"]
        items = [(str(rel), int(size), str(digest)) for rel, (size, digest) in files.items()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{CHECKSUMS} is unreadable ({type(e).__name__}: {e})"
    for rel, size, digest in items:
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        got = os.path.getsize(path)
        if got != size:
            return f"{rel} has {got} bytes; expected {size}"
        if _sha256(path) != digest:
            return f"{rel} does not match its checksum (the file changed after the save)"
    return None
