"""Pack a folder of images and videos with captions into raw WebDataset shards (what data/raw.py reads).

    pack_folder(folder, out, maxcount, maxsize)  →  out/shard-00000.tar, shard-00001.tar, …, out/pack_skipped.jsonl

Pairing. The folder is walked recursively in sorted order. A media file (IMAGE_EXTS, VIDEO_EXTS of data/raw.py,
any case) is paired with the caption files of the same stem in the same folder: `a/clip.mp4` with `a/clip.txt`
and/or `a/clip.json`. Each media file is one sample (`clip.mp4` and `clip.jpg` beside one `clip.txt` are two
samples with that caption). A sample's members are the media, named by its lower-case extension (`jpeg` → `jpg`),
and each caption file, copied byte for byte: nothing is decoded, so packing runs at the speed of the disk.

Keys. The media's path relative to the folder without its extension, every run of characters other than letters,
digits, `_` and `-` replaced by `_` (`a/my clip.v2.mp4` → `a_my_clip_v2`): a valid WebDataset key (no dot, no
separator). When that key is taken (`a/b.mp4` and `a_b.mp4`, `clip.mp4` and `clip.jpg`; compared case-blind, so
that extracting on a case-insensitive disk loses nothing) it gets `_` + 8 hex digits of the SHA-1 of the path.

Skipped, counted by reason and listed in out/pack_skipped.jsonl ({path, reason, why}; the index of the shards
writes its own skipped.jsonl beside them), never an error:
    missing_caption     a media file with no txt/json of its stem
    empty_caption       the caption data/raw.py reads (the txt when there is one, else the json) is blank, or a
                        json without a caption field
    unreadable_caption  the caption is one data/raw.py's parse_caption refuses (not UTF-8, not text, bad json)
    caption_too_large   a txt or json file over data/raw.py's MAX_CAPTION_BYTES (1 MiB): not read past the cap
    no_media            a caption file with no media file of its stem
    duplicate_caption   a second caption file of one stem and extension (`clip.txt` beside `clip.TXT`)
    unknown_extension   any other file
    empty_file          a media file of 0 bytes
    unreadable          a file or folder that cannot be read: no permission, a broken link, not a regular file
    hidden              a file or folder whose name starts with "." (.DS_Store, macOS' ._clip.mp4, .git)
    link_outside        a link to a file or folder outside the packed folder (not followed, nothing of it read:
                        no escaping the folder, so a linked ~/.ssh/id_rsa never lands in a shard or a log)
    link_loop           a link to a folder inside the packed folder, or to one already linked (not followed: no
                        loops, no sample twice)
Links to files inside the folder are followed. Every file is opened by data/index.py's open_input, so a file swapped
for an outside link or a device after the walk is refused too. An output folder inside the packed folder is not
walked.

Shards. `webdataset.ShardWriter` with pax tar headers (keys of any length and script): a shard is closed once it
holds `maxcount` samples or `maxsize` bytes of members, so a shard may pass maxsize by its last sample. Members
carry a fixed mtime, so packing the same folder twice gives the same bytes. An `out` that already holds
shard-*.tar is refused unless `overwrite`, which first removes those shards and the files that described them
(the pack's list and the shards' index).
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

from data.index import CORPUS_FILE, INDEX_FILE, open_input, write_jsonl
from data.raw import (IMAGE_EXTS, MAX_CAPTION_BYTES, PARTS_DIR, SKIPPED_FILE, VIDEO_EXTS, CaptionTooLarge,
                      UnreadableCaption, parse_caption)

SHARD_PATTERN = "shard-%05d.tar"
PACK_SKIPPED_FILE = "pack_skipped.jsonl"
EXT_ALIASES = {"jpeg": "jpg"}
CAPTION_EXTS = ("txt", "json")
MEDIA_EXTS = tuple(dict.fromkeys(EXT_ALIASES.get(e, e) for e in IMAGE_EXTS + VIDEO_EXTS))
MTIME = 1_700_000_000  # fixed member mtime: the same folder packs to the same bytes
_NOT_KEY = re.compile(r"[^\w\-]+")


@dataclass
class PackResult:
    """What pack_folder wrote: shard paths in order, sample counts by kind, member bytes, skips by reason."""
    out: str
    shards: list[str] = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)
    bytes: int = 0
    skipped: list[dict] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(self.kinds.values())

    @property
    def skip_counts(self) -> Counter:
        return Counter(k["reason"] for k in self.skipped)


# -- walking ----------------------------------------------------------------------------------------------------------

def walk_files(root: str, exclude: Optional[str] = None) -> tuple[list[str], list[dict]]:
    """(relative paths of the regular files under root, sorted; skipped entries) — see the module docstring.

    Links to folders are followed after every real folder has been walked, so that a link to a folder inside the
    tree is the duplicate (link_loop), never the real folder."""
    root_real = os.path.realpath(root)
    files, skipped, links = [], [], []
    seen = {root_real}
    stack = [root]
    while stack or links:
        if not stack:
            rel, real = links.pop(0)
            if os.path.commonpath([real, root_real]) != root_real:
                skipped.append(_skip(rel, "link_outside", f"a link to {real}, outside the folder"))
            elif real in seen:
                skipped.append(_skip(rel, "link_loop", f"a link to {real}, a folder already walked"))
            else:
                seen.add(real)
                stack.append(os.path.join(root, rel))
            continue
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            skipped.append(_skip(os.path.relpath(d, root), "unreadable", f"{type(e).__name__}: {e}"))
            continue
        for e in entries:
            rel = os.path.relpath(e.path, root)
            if e.name.startswith("."):
                skipped.append(_skip(rel, "hidden", "its name starts with '.'"))
            elif _is_dir(e):
                real = os.path.realpath(e.path)
                if real == exclude:
                    continue  # the output folder: its shards are not input
                if e.is_symlink():
                    links.append((rel, real))
                else:
                    seen.add(real)
                    stack.append(e.path)
            elif e.is_symlink() and os.path.commonpath([os.path.realpath(e.path), root_real]) != root_real:
                # checked before any stat of the target: nothing outside the folder is read, not even its kind
                skipped.append(_skip(rel, "link_outside", "a link to a file outside the folder (not read)"))
            elif _is_file(e):
                files.append(rel)
            else:
                skipped.append(_skip(rel, "unreadable", "a broken link, or not a regular file"))
    return sorted(files), skipped


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=True)
    except OSError:  # a link loop of links to links: stat fails
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file(follow_symlinks=True)  # False for fifos and sockets: reading one would block
    except OSError:
        return False


def _skip(path: str, reason: str, why: str) -> dict:
    return {"path": path, "reason": reason, "why": why}


# -- pairing ----------------------------------------------------------------------------------------------------------

@dataclass
class Group:
    """The files of one stem in one folder: media (relative path, member ext) and captions {ext: relative path}."""
    media: list[tuple[str, str]] = field(default_factory=list)
    captions: dict[str, str] = field(default_factory=dict)


def group_files(files: list[str]) -> tuple[dict[str, Group], list[dict]]:
    """{stem path: Group} in sorted order, and the files that belong to no sample kind (unknown_extension,
    duplicate_caption)."""
    groups: dict[str, Group] = defaultdict(Group)
    skipped = []
    for rel in files:
        stem, dot_ext = os.path.splitext(rel)
        ext = EXT_ALIASES.get(dot_ext[1:].lower(), dot_ext[1:].lower())
        if ext in MEDIA_EXTS:
            groups[stem].media.append((rel, ext))
        elif ext in CAPTION_EXTS:
            if ext in groups[stem].captions:
                skipped.append(_skip(rel, "duplicate_caption", f"{groups[stem].captions[ext]} is the {ext} caption"))
            else:
                groups[stem].captions[ext] = rel
        else:
            skipped.append(_skip(rel, "unknown_extension",
                                 f"not media ({', '.join(MEDIA_EXTS)}) nor a caption (txt, json)"))
    return dict(sorted(groups.items())), skipped


def make_key(rel_media: str, taken: set[str]) -> str:
    """A unique WebDataset key for the media file at `rel_media` (rule in the module docstring); adds it to `taken`."""
    base = _NOT_KEY.sub("_", os.path.splitext(rel_media)[0]) or "_"
    digest = hashlib.sha1(rel_media.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    key, n = base, 1
    while key.casefold() in taken:
        key = f"{base}_{digest}" + (f"_{n}" if n > 1 else "")
        n += 1
    taken.add(key.casefold())
    return key


def read_captions(root: str, group: Group) -> tuple[Optional[dict[str, bytes]], str, str]:
    """({ext: bytes} of the group's captions, "", "") when data/raw.py would read a caption from them, else
    (None, reason, why). The caption read is the txt when there is one, else the json (data/raw.py's order)."""
    if not group.captions:
        return None, "missing_caption", "no txt or json file of the same stem beside it"
    members = {}
    for ext, rel in group.captions.items():
        try:
            members[ext] = _read(root, rel, MAX_CAPTION_BYTES)
        except CaptionTooLarge as e:
            return None, e.reason, f"{rel}: {e}"
        except OSError as e:
            return None, "unreadable", f"{rel}: {type(e).__name__}: {e}"
    ext = "txt" if "txt" in members else "json"
    try:
        caption, _ = parse_caption(members[ext], ext)
    except UnreadableCaption as e:
        return None, "unreadable_caption", f"{group.captions[ext]}: {e}"
    if not caption:
        return None, "empty_caption", f"{group.captions[ext]} holds no caption"
    return members, "", ""


def _read(root: str, rel: str, limit: Optional[int] = None) -> bytes:
    """The bytes of root/rel, opened by open_input: a file swapped for a link out of root, or for a device or a fifo,
    since the walk is refused (InputRefused, an OSError: skipped as unreadable). Over `limit` bytes (captions):
    CaptionTooLarge, after reading no more than limit + 1."""
    with os.fdopen(open_input(os.path.join(root, rel), root), "rb") as f:
        data = f.read(-1 if limit is None else limit + 1)
    if limit is not None and len(data) > limit:
        raise CaptionTooLarge(f"over the {limit}-byte cap on captions")
    return data


# -- the output folder ------------------------------------------------------------------------------------------------

def existing_shards(out: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(out), "shard-*.tar")))


def clear_output(out: str) -> None:
    """Remove earlier shards from `out` and the files that described them (the pack's list, the raw index): a
    leftover shard-00009.tar would otherwise join the new corpus through shard-*.tar."""
    for path in existing_shards(out):
        os.remove(path)
    for name in (PACK_SKIPPED_FILE, INDEX_FILE, CORPUS_FILE, SKIPPED_FILE):
        if os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    shutil.rmtree(os.path.join(out, PARTS_DIR), ignore_errors=True)


def check_args(folder: str, out: str, maxcount: int, maxsize: float, overwrite: bool) -> None:
    """ValueError, naming the flag and the fix, for arguments that cannot pack."""
    if not os.path.isdir(folder):
        raise ValueError(f"FOLDER {folder!r} is not a folder: name the folder of media and captions to pack")
    if os.path.realpath(out) == os.path.realpath(folder):
        raise ValueError(f"--out {out!r} is the packed folder itself: choose another folder (a subfolder is fine)")
    if isinstance(maxcount, bool) or not isinstance(maxcount, int) or maxcount < 1:
        raise ValueError(f"--maxcount must be a whole number ≥ 1 (samples per shard), got {maxcount!r}")
    if not maxsize > 0:
        raise ValueError(f"--maxsize-mb must be > 0 (MB of members per shard), got {maxsize / 1e6:g}")
    old = existing_shards(out)
    if old and not overwrite:
        raise ValueError(f"--out {out!r} already holds {len(old)} shard-*.tar file(s), e.g. "
                         f"{os.path.basename(old[0])}: pass --overwrite to replace them, or choose another --out")


# -- packing ----------------------------------------------------------------------------------------------------------

def pack_folder(folder: str, out: str, maxcount: int = 10_000, maxsize: float = 1e9, overwrite: bool = False,
                progress: Optional[Callable[[int, int], None]] = None) -> PackResult:
    """Pack `folder` into out/shard-%05d.tar (rules in the module docstring); returns what was written. Writes no
    shard when no sample pairs. ValueError (naming the flag) for a missing folder, bad limits, or an `out` that
    already holds shards without `overwrite`."""
    check_args(folder, out, maxcount, maxsize, overwrite)
    os.makedirs(out, exist_ok=True)
    if overwrite:
        clear_output(out)
    files, skipped = walk_files(folder, exclude=os.path.realpath(out))
    groups, odd = group_files(files)
    skipped += odd
    result = PackResult(out=out, skipped=skipped)
    writer, taken = None, set()
    n_media, done = sum(len(g.media) for g in groups.values()), 0
    try:
        for g in groups.values():
            if not g.media:
                skipped += [_skip(rel, "no_media", "no media file of the same stem beside it")
                            for rel in g.captions.values()]
                continue
            captions, reason, why = read_captions(folder, g)
            for rel, ext in g.media:
                done += 1
                sample = _sample(folder, rel, ext, captions, reason, why, skipped)
                if sample is not None:
                    if writer is None:  # opened at the first sample: an empty folder leaves no empty shard
                        writer = _writer(out, maxcount, maxsize, result.shards)
                    writer.write({"__key__": make_key(rel, taken), **sample})
                    result.kinds["video" if ext in VIDEO_EXTS else "image"] += 1
                    result.bytes += sum(len(v) for v in sample.values())
                if progress:
                    progress(done, n_media)
    finally:
        if writer is not None:
            writer.close()
    result.skipped = sorted(skipped, key=lambda k: k["path"])
    # surrogateescape: a file name that is not UTF-8 is written back as the bytes it has on disk
    write_jsonl(os.path.join(out, PACK_SKIPPED_FILE), result.skipped, ensure_ascii=False)
    return result


def _sample(root: str, rel: str, ext: str, captions: Optional[dict], reason: str, why: str,
            skipped: list) -> Optional[dict]:
    """The members of one sample, or None with its skip appended."""
    if captions is None:
        skipped.append(_skip(rel, reason, why))
        return None
    try:
        data = _read(root, rel)
    except OSError as e:
        skipped.append(_skip(rel, "unreadable", f"{type(e).__name__}: {e}"))
        return None
    if not data:
        skipped.append(_skip(rel, "empty_file", "0 bytes"))
        return None
    return {ext: data, **captions}


def _writer(out: str, maxcount: int, maxsize: float, shards: list):
    """A ShardWriter into out/shard-%05d.tar (pax headers: keys of any length and script) that appends each shard
    to `shards` once it is closed."""
    import webdataset as wds

    files = {}

    def opener(path):  # plain files: webdataset's own opener reads "x:..." as a URL scheme
        files[path] = open(path, "wb")
        return files[path]

    def closed(path):  # TarWriter leaves a file it did not open to its opener
        files.pop(path).close()
        shards.append(path)

    pattern = os.path.join(out.replace("%", "%%"), SHARD_PATTERN)  # ShardWriter %-formats the whole pattern
    return wds.ShardWriter(pattern, maxcount=maxcount, maxsize=maxsize, post=closed, opener=opener, verbose=0,
                           mtime=MTIME, mode=0o644, format="PAX_FORMAT")
