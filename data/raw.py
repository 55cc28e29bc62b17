"""Raw corpora: WebDataset shards of images and videos with captions → the sample index → buckets → pixels.

A sample is an image (jpg/png/webp) or a video (mp4/webm/mkv/mov) with a caption (`txt`, or `json` with a caption
field, which may also carry fps/size metadata). The index (docs/contracts.md §2) is built from tar headers and container
headers only; nothing is decoded until the loader asks:

    expand_urls(urls)      brace patterns ("shard-{000..099}.tar"), globs, a list file (one path a line, relative to
                           the file) or a list of these → shard paths; a pattern that matches nothing is an error
    index_corpus(...)      shards → index.jsonl, corpus.json, skipped.jsonl; parallel over shards, and resumable:
                           each shard's probe results are kept in .index_parts/ and reused while the shard is unchanged
    assign_bucket(...)     a sample → the nearest bucket by duration, then aspect ratio, never upscaled past
                           `max_upscale`, or the reason it has none (too_large, too_short, too_small, extreme_aspect)
    load_raw(...)          read + decode one sample for its bucket (what a loader worker runs)

Bucket choice. A sample of more than raw.max_pixels pixels (an image, or a video's frame) has none (too_large).
Among the buckets of the sample's kind (images → 1-frame buckets, videos → the others):
    1. duration: frames ≤ usable_frames(n, fps, raw.fps) (data/decode.py): a clip is never padded in time;
    2. aspect:   d = |log(w/h) − log(W/H)|, and the crop it implies 1 − e^(−d) ≤ raw.max_crop;
    3. size:     the resize to cover, max(H/h, W/w) ≤ raw.max_upscale;
    then, of the buckets within raw.aspect_tolerance of the best d: the longest, then one that needs no enlarging
    (else the least), then the largest — so 1080p footage goes to 720p buckets and 480p footage stays at 480p.
Records keep the native metadata, so a corpus is re-bucketed for another bucket table (or another max_pixels)
without re-probing.

Captions. A sample's caption is the `txt` member, or the first of the json fields caption/text/prompt/txt that holds
a non-empty string. It is unreadable (UnreadableCaption, data/skipped_unreadable_caption) when the member's bytes
are not strict UTF-8 (a leading BOM is allowed), the json does not parse or is not an object, no caption field holds
a string but one holds something else (a number, a list, an object), or the text holds a NUL character or more than
MAX_CONTROL_SHARE of its characters are control characters (Unicode category Cc other than tab, newline, carriage
return): binary bytes that happen to decode. A caption member over MAX_CAPTION_BYTES (1 MiB) is not read at all
(CaptionTooLarge, data/skipped_caption_too_large), at indexing and at load. It is missing (missing_caption) when there is no txt/json member or the
caption is empty or blank.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from data.buckets import Bucket
from data.decode import DecodeError, decode_image, decode_video, probe_image, probe_video, usable_frames
from data.index import CorruptIndex, SampleIndex, read_json, read_jsonl, read_range, scan_tar, write_file, write_jsonl

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
VIDEO_EXTS = ("mp4", "webm", "mkv", "mov")
CAPTION_FIELDS = ("caption", "text", "prompt", "txt")
PARTS_DIR = ".index_parts"
SKIPPED_FILE = "skipped.jsonl"
CLIP_MODES = ("random", "start", "centre")
SHARD_REASONS = ("unreadable_shard", "link_outside", "not_regular")  # skips that count whole shards
MAX_CONTROL_SHARE = 0.1  # a caption with more control characters than this is binary, not text
MAX_CAPTION_BYTES = 1 << 20  # a txt/json member larger than this is not read (caption_too_large): text encoders
                             # read a few hundred tokens, and checking 10 MB of text cost seconds at every load
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # Unicode category Cc but tab, newline, CR


@dataclass
class RawConfig:
    """How raw samples become bucket-sized pixels (`data.raw`)."""
    fps: float = 16.0               # target frame rate of clips (Wan 2.1 trains at 16 fps)
    max_upscale: float = 1.5        # a sample is never enlarged by more than this to cover its bucket
    max_crop: float = 0.5           # the largest fraction of the frame the centre-crop may cut (aspect mismatch)
    aspect_tolerance: float = 0.05  # |Δ log aspect| within which buckets count as one shape (then longest, largest)
    clip: str = "random"            # where a clip starts in a longer video: random (keyed by seed, epoch, key),
                                    # start, or centre
    decode_threads: int = 1         # FFmpeg threads per decode; the loader already decodes samples in parallel
    max_pixels: int = 1 << 26       # the most pixels (width × height) of an image or video frame; larger: too_large.
                                    # 8192² = 67 M: passes 8K UHD (33 M) and 8K squares, stays under PIL's own bomb
                                    # limit (89 M), and bounds one decode to 192 MiB of RGB per decoding thread

    def __post_init__(self):
        if self.fps <= 0:
            raise ValueError(f"data.raw.fps must be > 0, got {self.fps}")
        if self.max_upscale < 1:
            raise ValueError(f"data.raw.max_upscale must be ≥ 1 (1: never enlarge), got {self.max_upscale}")
        if not 0 <= self.max_crop < 1:
            raise ValueError(f"data.raw.max_crop must lie in [0, 1), got {self.max_crop}")
        if self.aspect_tolerance < 0:
            raise ValueError(f"data.raw.aspect_tolerance must be ≥ 0, got {self.aspect_tolerance}")
        if self.clip not in CLIP_MODES:
            raise ValueError(f"data.raw.clip must be one of {CLIP_MODES}, got {self.clip!r}")
        if self.decode_threads < 0:
            raise ValueError(f"data.raw.decode_threads must be ≥ 0 (0: FFmpeg's choice), got {self.decode_threads}")
        if int(self.max_pixels) < 1:
            raise ValueError(f"data.raw.max_pixels must be ≥ 1 (the most pixels of an image or video frame), "
                             f"got {self.max_pixels}")


class MissingCaption(DecodeError):
    reason = "missing_caption"


class UnreadableCaption(DecodeError):
    """A caption member that is not text (see the module docstring for the rule)."""
    reason = "unreadable_caption"


class CaptionTooLarge(DecodeError):
    """A caption member over MAX_CAPTION_BYTES: skipped unread."""
    reason = "caption_too_large"


def check_caption_size(size: int, ext: str) -> None:
    """CaptionTooLarge when a caption member of `size` bytes is over MAX_CAPTION_BYTES (checked before reading it)."""
    if size > MAX_CAPTION_BYTES:
        raise CaptionTooLarge(f"the {ext} member holds {size} bytes, over the {MAX_CAPTION_BYTES}-byte cap on captions")


# -- shards -----------------------------------------------------------------------------------------------------------

def expand_urls(urls: Union[str, Sequence[str]], where: str = "data.urls") -> list[str]:
    """Shard paths named by brace patterns, globs, list files (.txt/.list/.shards) or a list of these, in order."""
    from braceexpand import braceexpand

    if isinstance(urls, str):
        urls = [urls]
    out: list[str] = []
    for pattern in urls:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{where} entries must be non-empty strings, got {pattern!r}")
        pattern = os.path.expanduser(pattern)
        if pattern.endswith((".txt", ".list", ".shards")) and os.path.isfile(pattern):
            base = os.path.dirname(os.path.abspath(pattern))
            with open(pattern) as f:
                lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
            found = expand_urls([ln if os.path.isabs(ln) else os.path.join(base, ln) for ln in lines], where)
            out.extend(found)
            continue
        matched = []
        for p in braceexpand(pattern):
            matched.extend(sorted(glob.glob(p)) if glob.has_magic(p) else ([p] if os.path.isfile(p) else []))
        if not matched:
            raise ValueError(f"{where}: {pattern!r} matches no file " + (
                folder_hint(pattern, where) if os.path.isdir(pattern) else
                "(brace patterns like shard-{000..009}.tar, globs and list files are accepted)"))
        out.extend(matched)
    return list(dict.fromkeys(os.path.abspath(p) for p in out))  # in order, each shard once


def folder_hint(folder: str, where: str) -> str:
    """What to write instead of a folder: the glob of its shards (`shard-*.tar` as pack_media.py and
    precompute_latents.py name them, else `*.tar`), and data.index first when it holds a corpus index."""
    folder = folder.rstrip("/") or "/"
    names = [n for n in os.listdir(folder) if n.endswith(".tar")]
    indexed = any(os.path.exists(os.path.join(folder, f)) for f in ("corpus.json", "index.jsonl"))
    glob_ = os.path.join(folder, "shard-*.tar" if all(n.startswith("shard-") for n in names) else "*.tar")
    if indexed:
        return f"(it is a corpus folder: use data.index={folder}" + (
            f", or {where}='{glob_}' for its shards)" if names else ")")
    found = f"it holds {len(names)} .tar file(s)" if names else "it holds no .tar file yet"
    return f"(it is a folder, and {found}): use {where}='{glob_}'"


def common_dir(paths: Sequence[str]) -> str:
    return os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])


def _rel(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)
    return path if rel.startswith("..") else rel


# -- probing (no decode) ----------------------------------------------------------------------------------------------

def _check_text(text: str) -> str:
    if "\0" in text:
        raise UnreadableCaption("the caption holds NUL characters")
    control = len(_CONTROL.findall(text))
    if control > MAX_CONTROL_SHARE * len(text):
        raise UnreadableCaption(f"{control} of the caption's {len(text)} characters are control characters")
    return text.strip()


def parse_caption(data: bytes, ext: str) -> tuple[str, dict]:
    """(caption, metadata) from a txt or json member; the caption is "" when absent. UnreadableCaption when the
    member is not text (the rule is in the module docstring)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UnreadableCaption(f"the {ext} member is not UTF-8: {e}") from None
    if ext == "txt":
        return _check_text(text), {}
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise UnreadableCaption(f"the json member does not parse: {e}") from None
    if not isinstance(meta, dict):
        raise UnreadableCaption(f"the json member is a {type(meta).__name__}, not an object")
    caption = next((meta[k] for k in CAPTION_FIELDS if isinstance(meta.get(k), str) and meta[k].strip()), None)
    if caption is None:
        odd = {k: type(meta[k]).__name__ for k in CAPTION_FIELDS if meta.get(k) is not None
               and not isinstance(meta[k], str)}
        if odd:
            raise UnreadableCaption(f"json caption fields that are not strings: {odd}")
        return "", meta
    return _check_text(caption), meta


def _caption_ext(members: Mapping) -> Optional[str]:
    return "txt" if "txt" in members else ("json" if "json" in members else None)


def probe_sample(path: str, key: str, members: Mapping[str, Sequence[int]]) -> tuple[Optional[dict], str, str]:
    """(record fields, "", "") for a usable sample, else (None, reason, why). Reads the caption and media headers.
    The size cap (too_large) is a bucket rule, applied by assign_bucket: probing reads headers only."""
    media = [e for e in members if e in IMAGE_EXTS or e in VIDEO_EXTS]
    if not media:
        return None, "no_media", f"no image or video member among {sorted(members)}"
    ext = media[0]
    cap_ext = _caption_ext(members)
    if cap_ext is None:
        return None, "missing_caption", "no txt or json member"
    try:
        check_caption_size(members[cap_ext][1], cap_ext)
        caption, meta = parse_caption(read_range(path, *members[cap_ext]), cap_ext)
    except (UnreadableCaption, CaptionTooLarge) as e:
        return None, e.reason, str(e)
    if not caption:
        return None, "missing_caption", f"empty caption in {cap_ext}"
    offset, size = members[ext]
    if ext in VIDEO_EXTS:
        kind = "video"
        if size == 0:
            return None, "no_frames", "empty video member"
        try:
            info = probe_video(read_range(path, offset, size))
        except DecodeError as e:
            return None, "corrupt_video", str(e)
        if info["frames"] < 1:
            return None, "no_frames", "the container holds no video frames"
        if info["fps"] <= 0 and _number(meta.get("fps")) > 0:
            info["fps"] = float(meta["fps"])
    else:
        kind = "image"
        try:
            info = probe_image(read_range(path, offset, size))
        except DecodeError as e:
            return None, "corrupt_image", str(e)
    rec = {"kind": kind, "media": ext, "caption": cap_ext, "frames": int(info["frames"]),
           "fps": round(float(info["fps"]), 6), "height": int(info["height"]), "width": int(info["width"])}
    return rec, "", ""


def _number(x) -> float:
    """A json metadata value as a number; 0 when it is none."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return 0.0


def probe_shard(path: str, rel: str) -> dict:
    """One shard's part of the index: records (without bucket) and skipped samples, in tar order. A shard that is not
    a readable tar is one skipped entry (unreadable_shard, its path as the key), as is one that is a link leading out
    of its folder (link_outside) or not a regular file (not_regular: never opened); a sample whose probe fails in a
    way the probe does not name is skipped as unreadable; a later sample reusing a key of the tar, duplicate_key."""
    scan = scan_tar(path)
    part: dict = {"shard": rel, "records": [], "skipped": []}
    if scan.error:
        part["skipped"].append({"key": f"<shard {rel}>", "reason": scan.reason, "why": f"{path}: {scan.error}"})
        return part
    for key, reason in scan.broken.items():
        part["skipped"].append({"key": key, "reason": reason, "why": "seen in the tar headers"})
    for key in scan.duplicates:
        part["skipped"].append({"key": key, "reason": "duplicate_key", "why": "a later sample of this tar with the "
                                                                              "key of an earlier one (the first is kept)"})
    for key, members in scan.members.items():
        if key in scan.broken:
            continue
        try:
            rec, reason, why = probe_sample(path, key, members)
        except Exception as e:  # a failure no reason above names (an I/O error, a library's own exception)
            rec, reason, why = None, "unreadable", f"{type(e).__name__}: {e}"
        if rec is None:
            part["skipped"].append({"key": key, "reason": reason, "why": why})
            continue
        part["records"].append({"key": key, "shard": rel, "members": {e: list(v) for e, v in members.items()},
                                **rec, "bucket": None, "S": None, "L_text": None, "split": "train"})
    return part


# -- buckets ----------------------------------------------------------------------------------------------------------

def assign_bucket(kind: str, frames: int, fps: float, height: int, width: int, buckets: Mapping[str, Bucket],
                  cfg: RawConfig) -> tuple[Optional[Bucket], str]:
    """(the nearest bucket, "") or (None, reason): see the module docstring for the rule."""
    cands = [b for b in buckets.values() if b.is_image == (kind == "image")]
    if not cands:
        return None, f"no_{kind}_bucket"
    if height < 1 or width < 1:
        return None, "too_small"
    if height * width > cfg.max_pixels:
        return None, "too_large"
    if kind == "video":
        avail = usable_frames(frames, fps, cfg.fps)
        cands = [b for b in cands if b.frames <= avail]
        if not cands:
            return None, "too_short"
    ar = math.log(width / height)
    dist = {b.name: abs(ar - math.log(b.width / b.height)) for b in cands}
    max_d = -math.log(1 - cfg.max_crop)
    cands = [b for b in cands if dist[b.name] <= max_d + 1e-9]
    if not cands:
        return None, "extreme_aspect"
    cands = [b for b in cands if max(b.height / height, b.width / width) <= cfg.max_upscale + 1e-9]
    if not cands:
        return None, "too_small"
    best = min(dist[b.name] for b in cands)
    near = [b for b in cands if dist[b.name] <= best + cfg.aspect_tolerance]
    # longest; then no enlargement over some (the least); then the largest; then the closest shape
    up = {b.name: max(1.0, b.height / height, b.width / width) for b in near}
    return max(near, key=lambda b: (b.frames, -up[b.name], b.height * b.width, -dist[b.name], b.name)), ""


def bucket_records(records: Iterable[dict], buckets: Mapping[str, Bucket], cfg: RawConfig
                   ) -> tuple[list[dict], list[dict]]:
    """(every record, with bucket and S set or null, in order; skipped entries of those with no bucket)."""
    out, skipped = [], []
    for r in records:
        b, reason = assign_bucket(r["kind"], r["frames"], r["fps"], r["height"], r["width"], buckets, cfg)
        out.append({**r, "bucket": b.name if b else None, "S": b.tokens if b else None})
        if b is None:
            what = f"{r['width']}×{r['height']}" + (f", {r['frames']} frames at {r['fps']:g} fps"
                                                     if r["kind"] == "video" else "")
            skipped.append({"key": r["key"], "shard": r["shard"], "reason": reason, "stage": "bucket",
                            "why": f"{r['kind']} {what}"})
    return out, skipped


# -- the index --------------------------------------------------------------------------------------------------------

def _part_path(out_dir: str, rel: str) -> str:
    h = hashlib.sha1(rel.encode()).hexdigest()[:12]
    return os.path.join(out_dir, PARTS_DIR, f"{os.path.basename(rel)}.{h}.json")


def _stamp(shard: str) -> list:
    try:
        st = os.stat(shard)
    except OSError:  # a broken link: probed (and skipped as not_regular) like any other shard
        return [-1, -1]
    return [st.st_size, st.st_mtime_ns]


def _load_part(out_dir: str, shard: str, rel: str) -> Optional[dict]:
    """The saved probe results of a shard, if the shard has not changed since (size and mtime)."""
    try:
        part = read_json(_part_path(out_dir, rel))
        return part if isinstance(part, dict) and part.get("shard") == rel and part.get("stamp") == _stamp(shard) \
            else None
    except (OSError, ValueError):
        return None


def _probe_and_save(args) -> dict:
    shard, rel, out_dir = args
    stamp = _stamp(shard)
    part = {"stamp": stamp, **probe_shard(shard, rel)}
    path = _part_path(out_dir, rel)
    write_file(path, json.dumps(part, separators=(",", ":")).encode())  # whole or not at all: a killed run resumes
    return {"shard": rel, "records": len(part["records"]), "skipped": len(part["skipped"])}


def index_corpus(shards: Sequence[str], out_dir: str, buckets: Mapping[str, Bucket], cfg: RawConfig,
                 workers: int = 1, progress=None) -> SampleIndex:
    """Index raw shards into out_dir (beside them by default); returns the index (every probed sample, bucketed).

    Samples with no bucket under this table stay in index.jsonl with bucket null (another table may use them);
    every skipped sample is listed in skipped.jsonl with its reason, and each reason is logged once with a key.
    """
    if not shards:
        raise ValueError("no shards to index")
    os.makedirs(os.path.join(out_dir, PARTS_DIR), exist_ok=True)
    rels = [_rel(s, out_dir) for s in shards]
    todo = [(s, r, out_dir) for s, r in zip(shards, rels) if _load_part(out_dir, s, r) is None]
    if workers > 1 and len(todo) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        # spawn: the caller may hold torch's threads, which a forked child must not inherit
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=mp.get_context("spawn")) as ex:
            for done in ex.map(_probe_and_save, todo):
                progress and progress(done)
    else:
        for t in todo:
            done = _probe_and_save(t)
            progress and progress(done)
    records, skipped = [], []
    for s, r in zip(shards, rels):
        part = _load_part(out_dir, s, r)
        if part is None:
            raise RuntimeError(f"{s} changed while it was being indexed: run the indexer again")
        records.extend(part["records"])
        skipped.extend({**k, "shard": r, "stage": "probe"} for k in part["skipped"])
    records, bucket_skips = bucket_records(records, buckets, cfg)
    write_jsonl(os.path.join(out_dir, SKIPPED_FILE), skipped + bucket_skips)
    meta = {"kind": "raw", "writer": "data/raw.py index_corpus", "shards": rels, "raw": asdict(cfg),
            "skipped": dict(Counter(k["reason"] for k in skipped)),
            "buckets": {n: {"frames": b.frames, "height": b.height, "width": b.width} for n, b in buckets.items()}}
    index = SampleIndex(out_dir, meta, records)
    index.save()
    log_skips(skipped + bucket_skips, out_dir)
    return index


def log_skips(skipped: Sequence[dict], where: str) -> None:
    """One line per reason, with the first key and how many (the full list is in skipped.jsonl); every skipped shard
    (SHARD_REASONS) gets its own line, with its path."""
    first: dict[str, dict] = {}
    counts: Counter = Counter()
    for k in skipped:
        counts[k["reason"]] += 1
        first.setdefault(k["reason"], k)
        if k["reason"] in SHARD_REASONS:
            log.warning("%s: skipped a shard (%s): %s", where, k["reason"], k.get("why", k["key"]))
    for reason in SHARD_REASONS:
        counts.pop(reason, None)
    for reason, n in sorted(counts.items()):
        k = first[reason]
        log.warning("%s: skipped %d sample(s) as %s, e.g. %s (%s)", where, n, reason, k["key"], k.get("why", ""))


def ensure_raw_index(shards: Sequence[str], out_dir: str, buckets: Mapping[str, Bucket], cfg: RawConfig,
                     workers: int = 1) -> SampleIndex:
    """The index of these shards in out_dir, built or extended (resumably) when it does not cover them all. An index
    that does not parse is rebuilt with a warning: for shards it is a cache (the probe results in .index_parts/ are
    reused while valid)."""
    rels = [_rel(s, out_dir) for s in shards]
    try:
        index = SampleIndex.load(out_dir)
    except FileNotFoundError:
        return index_corpus(shards, out_dir, buckets, cfg, workers)
    except CorruptIndex as e:
        log.warning("%s; re-indexing the shards", e)
        return index_corpus(shards, out_dir, buckets, cfg, workers)
    have = index.meta.get("shards", []) if index.meta.get("kind") == "raw" else []
    if set(rels) <= set(have) and all(_load_part(out_dir, s, r) is not None for s, r in zip(shards, rels)):
        return index
    # the shards indexed before that still exist stay in, so that the index only grows
    old = [r if os.path.isabs(r) else os.path.join(out_dir, r) for r in have if r not in rels]
    return index_corpus(list(shards) + [p for p in old if os.path.isfile(p)], out_dir, buckets, cfg, workers)


def select_raw(index: SampleIndex, buckets: Mapping[str, Bucket], cfg: RawConfig,
               shards: Optional[Sequence[str]] = None) -> tuple[SampleIndex, Counter]:
    """The index restricted to `shards` (all when None), re-bucketed for this table: (index, skip counts by reason).

    The counts hold the samples the indexer skipped (from skipped.jsonl) and those with no bucket in this table.
    """
    want = None if shards is None else {_rel(s, index.root) for s in shards}
    records, bucket_skips = bucket_records([r for r in index.records if want is None or r["shard"] in want],
                                           buckets, cfg)
    counts: Counter = Counter()
    path = os.path.join(index.root, SKIPPED_FILE)
    if os.path.exists(path):
        try:
            listed = read_jsonl(path, ("reason",))
        except CorruptIndex as e:  # only counts are lost: the index itself is whole
            log.warning("%s; the samples skipped at indexing are not counted", e)
            listed = []
        for k in listed:
            if k.get("stage") == "probe" and (want is None or k.get("shard") in want):
                counts[k["reason"]] += 1
    counts.update(k["reason"] for k in bucket_skips)
    log_skips(bucket_skips, index.root)
    return SampleIndex(index.root, index.meta, [r for r in records if r["bucket"] is not None]), counts


# -- loading ----------------------------------------------------------------------------------------------------------

def read_caption(index: SampleIndex, row: int) -> str:
    """The caption of a raw sample; UnreadableCaption, CaptionTooLarge or MissingCaption (DecodeErrors) when it has
    none."""
    r = index.records[row]
    check_caption_size(r["members"][r["caption"]][1], r["caption"])
    caption, _ = parse_caption(index.read(row, r["caption"]), r["caption"])
    if not caption:
        raise MissingCaption("empty caption")
    return caption


def clip_start(cfg: RawConfig, u: float) -> float:
    """Where the clip starts, as a fraction of the free room: `u` is the keyed uniform draw for random clips."""
    return {"random": u, "start": 0.0, "centre": 0.5}[cfg.clip]


def load_raw(index: SampleIndex, row: int, bucket: Bucket, cfg: RawConfig, start: float) -> tuple[np.ndarray, str]:
    """(pixels [F, H, W, 3] uint8 for the bucket, caption) of one raw sample; DecodeError says why it cannot be
    (TooLarge over raw.max_pixels, whatever the index recorded: the member may have changed since)."""
    r = index.records[row]
    caption = read_caption(index, row)
    data = index.read(row, r["media"])
    if r["kind"] == "image":
        return decode_image(data, bucket.height, bucket.width, cfg.max_pixels), caption
    return decode_video(data, bucket.frames, bucket.height, bucket.width, cfg.fps, start, cfg.decode_threads,
                        cfg.max_pixels), caption
