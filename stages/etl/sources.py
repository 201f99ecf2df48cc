"""Listing and reading an untrusted source tree (local or s3://): only regular files inside it are read.

A source folder may hold anything: symlinks out of the tree (to /etc/passwd, /dev/zero), FIFOs
that block a reader forever, device files, names that are not UTF-8. Each such entry becomes a
quarantine row with its reason; none is read, none hangs the job, none is dropped silently.
Every read is capped at etl.max_file_mb, whatever the listing said the size was.

Symlink policy (etl.follow_symlinks): "inside_source" (default) follows a link only when its
target resolves inside the source tree; "never" quarantines every link; "always" follows any.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import unicodedata
from dataclasses import dataclass
from typing import Any, Iterable

from stages.common import storage
from stages.common.config import ConfigError, EtlConfig
from stages.etl.images import BadImage

__all__ = ["READ_KEYS", "read_rules", "unused_read_settings", "Entry", "list_tree", "hidden_name", "check_spellings", "read_capped", "shown",
           "name_bytes", "tree_fingerprint", "skipped_linked_folders", "top_folders", "class_name", "class_of",
           "entry_row"]

log = logging.getLogger(__name__)

# The etl.* keys that say how source files are read; model.json `read` records them
# (stages.model.publish) so that infer and serve read new files by the same rules.
READ_KEYS = ("allowed_formats", "max_image_pixels", "max_file_mb", "follow_symlinks", "layout")
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    rel: str  # path relative to the root as the OS names it (undecodable bytes as surrogate escapes)
    size: int
    mtime: float
    problem: tuple[str, str] | None = None  # (reason, detail): listed, never read


def read_rules(info: dict) -> dict[str, Any]:
    """The ETL read settings of a model's training data (model.json `read`), for reading files the
    way its ETL did; a model published before `read` existed reads with ETL's defaults."""
    defaults = EtlConfig().model_dump(mode="json", include=set(READ_KEYS))
    return {**defaults, **(info.get("read") or {})}


def unused_read_settings(etl: dict[str, Any], info: dict) -> list[str]:
    """`etl.<key>` for each read key whose value in `etl` (a config's etl section, as JSON) differs
    from the model's own (`read_rules`): infer, and export's --data, read files with the model's
    rules, so such a key, from --set or a --config file, does nothing there."""
    rules = read_rules(info)
    return [f"etl.{k}" for k in READ_KEYS if k in etl and etl[k] != rules[k]]


def name_bytes(rel: str) -> bytes:
    """The file name's bytes: the same as UTF-8 for every valid name, and defined for the rest."""
    return rel.encode("utf-8", "surrogateescape")


def shown(rel: str) -> str:
    """A printable, valid UTF-8 form of a name: b'caf\\xe9.jpg' shows as 'caf\\\\xe9.jpg'."""
    return name_bytes(rel).decode("utf-8", "backslashreplace")


def class_name(folder: str) -> str:
    """A class folder's name as a class: printable, and in Unicode NFC, so that a folder copied from
    macOS (NFD: 'e' + combining accent) and one made elsewhere (NFC: one code point) are one class."""
    return unicodedata.normalize("NFC", shown(folder))


def check_printable(classes: Iterable[str]) -> None:
    """Refuse a class name holding a line break or another control character: labels.txt (one class
    a line: Triton's label_filename), logs and CSV outputs would read it as two (a folder named
    'new\\nline' had shifted every exported label after it)."""
    for name in classes:
        if any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") for ch in name):
            raise ConfigError(f"class folder {ascii(name)} has a line break or control character in its name; "
                              "rename the folder (a class name is one line of labels.txt)")


def check_spellings(spellings: dict[str, set[str]]) -> None:
    """One class per name. Folders that differ only in Unicode form (NFC, NFD) are one class, with
    a warning; folders that only print alike (b'caf\\xe9', not UTF-8, and a folder literally named
    'caf\\xe9') would silently share a label: refused, naming both."""
    for name, folders in spellings.items():
        if len({unicodedata.normalize("NFC", f) for f in folders}) > 1:
            raise ConfigError(f"folders {', '.join(map(ascii, sorted(folders)))} both show as class '{name}' "
                              f"(a name that is not UTF-8 prints escaped); rename one of them")
        if len(folders) > 1:
            log.warning("etl: folders %s spell one class name in two Unicode forms (NFC, NFD): one class, '%s'",
                        ", ".join(map(ascii, sorted(folders))), name)


def class_of(rel: str, depth: int = 0) -> str | None:
    """The class of a file at `rel`: its first folder, or with `depth` 1 the folder below its split's
    (stages.etl.layout); None for a file outside any class folder."""
    parts = rel.split("/")
    return class_name(parts[depth]) if len(parts) > depth + 1 else None


def tree_fingerprint(entries: list[Entry], empty_folders: list[str] = ()) -> str:
    """Cheap identity of a listing (names, sizes, mtimes): a changed or added file changes it, and
    so does an added empty class folder (a class of its own)."""
    rows: list = sorted((shown(e.rel), e.size, round(e.mtime, 6)) for e in entries)
    if empty_folders:  # absent otherwise, so the identity of every other tree stays as it was
        rows.append(["empty folders", sorted(empty_folders)])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def top_folders(fs, root: str) -> list[str]:
    """The real (not linked) folders right under a local root, hidden ones left out: the class
    folders, empty ones included. An object store has no empty folders, so there: none."""
    if not storage.is_local(fs):
        return []
    with os.scandir(root) as found:
        return [class_name(c.name) for c in found if not hidden_name(c.name) and c.is_dir(follow_symlinks=False)]


# What operating systems and NAS boxes write beside a user's files, compared case-insensitively:
# macOS zip's resource forks; Synology's thumbnails (`@eaDir/<image>/SYNOFILE_THUMB_*.jpg`, several
# sizes per image: read, they multiplied the data and put a test image's thumbnail in train) and
# recycle bins (Synology, QNAP, Windows); Windows' thumbnail caches and folder settings.
SYSTEM_NAMES = frozenset({"__macosx", "@eadir", "#recycle", "#snapshot", "@recycle", "$recycle.bin",
                          "system volume information", "thumbs.db", "ehthumbs.db", "desktop.ini"})


def hidden_name(name: str) -> bool:
    """A dotfile or dot-folder, or a file or folder a system or NAS writes beside the real tree
    (SYSTEM_NAMES): `__MACOSX/` read as a class became an empty one."""
    return name.startswith(".") or name.lower() in SYSTEM_NAMES


def list_tree(fs, root: str, policy: str) -> tuple[list[Entry], int]:
    """(entries sorted by name, hidden count). Hidden names (.DS_Store, .git/, __MACOSX/, @eaDir/,
    Thumbs.db: `hidden_name`) are skipped and counted."""
    entries, hidden = _list_local(root, policy) if storage.is_local(fs) else _list_object_store(fs, root)
    return sorted(entries, key=lambda e: name_bytes(e.rel)), hidden


def _list_object_store(fs, root: str) -> tuple[list[Entry], int]:
    entries, hidden = [], 0
    for path, info in fs.find(root, detail=True).items():
        rel = path[len(root):].lstrip("/")
        if info.get("type") == "directory" or not rel:
            continue
        if any(hidden_name(part) for part in rel.split("/")):
            hidden += 1
            continue
        modified = info.get("LastModified") or info.get("mtime") or 0
        mtime = modified.timestamp() if hasattr(modified, "timestamp") else float(modified)
        size = int(info.get("size") or 0)
        if rel.endswith("/"):  # "cat/": a console's or sync tool's folder marker, listed as a file
            if size:  # data under a folder's name: no image file can be read by that key
                entries.append(Entry(rel, size, mtime, ("not_a_regular_file", "an object whose key ends in '/'")))
            continue
        entries.append(Entry(rel, size, mtime))
    return entries, hidden


def _list_local(root: str, policy: str) -> tuple[list[Entry], int]:
    """Real folders first, then folders reached through links: a link to a folder that is also in
    the tree is the alias (quarantined), never the real folder, whatever order the OS lists them."""
    real_root = os.path.realpath(root)
    entries, hidden, pending, visited, links = [], 0, [""], {real_root}, []
    while pending or links:
        if not pending:  # every real folder is listed: now the folders only links lead to
            rel, real, mtime = links.pop(0)
            if real in visited:  # a link back up the tree, or to a folder listed already
                entries.append(Entry(rel, 0, mtime, ("symlink_loop", f"-> {shown(real)}")))
            else:
                visited.add(real)
                pending.append(rel)
            continue
        folder = pending.pop()
        for child in _children(root, folder, entries):
            rel = f"{folder}/{child.name}" if folder else child.name
            if hidden_name(child.name):
                hidden += 1
                continue
            try:
                info = child.stat(follow_symlinks=False)
            except OSError as e:
                entries.append(Entry(rel, 0, 0.0, ("read_error", f"not listed: {e.strerror or e}")))
                continue
            linked = stat.S_ISLNK(info.st_mode)
            if linked:
                problem, info = _follow(os.path.join(root, rel), real_root, policy, info)
                if problem:
                    entries.append(Entry(rel, 0, info.st_mtime, problem))
                    continue
            if stat.S_ISDIR(info.st_mode):
                real = os.path.realpath(os.path.join(root, rel))
                if linked:
                    links.append((rel, real, info.st_mtime))
                elif real in visited:  # a bind mount of a folder listed already
                    entries.append(Entry(rel, 0, info.st_mtime, ("symlink_loop", f"-> {shown(real)}")))
                else:
                    visited.add(real)
                    pending.append(rel)
            elif stat.S_ISREG(info.st_mode):
                entries.append(Entry(rel, info.st_size, info.st_mtime))
            else:
                entries.append(Entry(rel, 0, info.st_mtime, ("not_a_regular_file", _kind(info.st_mode))))
    return entries, hidden


def _children(root: str, folder: str, entries: list[Entry]) -> list[os.DirEntry]:
    """`folder`'s entries in byte order. A folder this user may not list (or one past PATH_MAX) is
    quarantined as a read_error, its files unread: one such folder must not fail the whole job."""
    try:
        with os.scandir(os.path.join(root, folder) if folder else root) as found:
            return sorted(found, key=lambda c: name_bytes(c.name))
    except OSError as e:
        if not folder:
            raise
        entries.append(Entry(folder, 0, 0.0, ("read_error", f"folder not listed: {e.strerror or e}")))
        return []


def _follow(path: str, real_root: str, policy: str, link_info: os.stat_result):
    """(problem or None, stat of what to list) for a symlink under the policy."""
    target = shown(os.readlink(path))
    if policy == "never":
        return ("symlink_not_followed", f"-> {target}; etl.follow_symlinks=never"), link_info
    try:
        info = os.stat(path)
    except OSError as e:
        reason = {errno.ELOOP: "symlink_loop", errno.ENOENT: "symlink_broken"}.get(e.errno, "read_error")
        return (reason, f"-> {target}: {e.strerror}"), link_info
    if policy == "inside_source" and not _inside(os.path.realpath(path), real_root):
        # infer reads with its model's ETL rules: a hint to set the key there did nothing
        return ("symlink_outside_source", f"-> {target}: outside the folder read, and etl.follow_symlinks="
                "inside_source skips it (ETL: set it to always; infer: the rule of its model's ETL)"), link_info
    return None, info


def skipped_linked_folders(fs, root: str, entries: list[Entry]) -> list[str]:
    """Links right under a local root to folders that the symlink policy did not follow: class
    folders that would vanish from the classes with no word but a quarantine row each."""
    skipped = ("symlink_outside_source", "symlink_not_followed")
    return [shown(e.rel) for e in entries if e.problem and e.problem[0] in skipped and "/" not in e.rel
            and storage.is_local(fs) and os.path.isdir(os.path.join(root, e.rel))]


def _inside(real: str, real_root: str) -> bool:
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_capped(fs, root: str, rel: str, cap_bytes: int, policy: str) -> bytes:
    """Read one listed file, at most `cap_bytes`; BadImage when it is too large or not a regular file."""
    path = storage.join(root, rel)
    if storage.is_local(fs):
        data = _read_local(path, root, cap_bytes, policy)
    else:
        try:
            data = fs.cat_file(path, start=0, end=cap_bytes + 1)
        except OSError:  # S3 answers a ranged read of an empty object with 416 (range not satisfiable)
            if fs.info(path).get("size") != 0:
                raise
            data = b""  # the decoder's empty_file, as for a local one (it had been a read_error)
    if len(data) > cap_bytes:
        raise BadImage("too_large", f"more than {cap_bytes} bytes (etl.max_file_mb)")
    return data


def _read_local(path: str, root: str, cap_bytes: int, policy: str) -> bytes:
    # Checked again at read time: the tree may have changed since it was listed.
    if policy == "inside_source" and not _inside(os.path.realpath(path), os.path.realpath(root)):
        raise BadImage("symlink_outside_source", "resolves outside the source tree")
    flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if policy == "never" else 0)  # a FIFO must not block
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise BadImage("not_a_regular_file", _kind(mode))
        chunks, total = [], 0
        while total <= cap_bytes and (chunk := os.read(fd, min(CHUNK_BYTES, cap_bytes + 1 - total))):
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def entry_row(entry: Entry) -> dict[str, Any]:
    """The quarantine row of a listed entry that is never read."""
    reason, detail = entry.problem or ("read_error", "")
    return {"path": shown(entry.rel), "size": entry.size, "sha256": None, "reason": reason, "detail": detail}
