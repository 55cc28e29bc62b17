"""data/pack.py and scripts/pack_media.py: a folder of real mp4/jpg/png files with captions → shards that data/raw.py
indexes, every paired sample exactly once and byte for byte, every other file skipped and counted by reason."""
import glob
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from data.buckets import bucket_table
from data.index import split_name
from data.pack import PACK_SKIPPED_FILE, pack_folder
from data.raw import RawConfig, index_corpus, parse_caption, read_caption
from data.video_io import write_mp4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- aws_secret_access_key=AKIAEXAMPLESECRET"
TINY = bucket_table({"img_64": {"frames": 1, "height": 64, "width": 64},
                     "img_64x96": {"frames": 1, "height": 64, "width": 96},
                     "vid_64_9f": {"frames": 9, "height": 64, "width": 64}})


def _image(path, seed, fmt, size=(64, 64)):
    img = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, fmt)
    _write(path, buf.getvalue())


def _video(path, seed):
    g = torch.Generator().manual_seed(seed)
    write_mp4(path, torch.rand(3, 17, 64, 64, generator=g) * 2 - 1, fps=16, preset="ultrafast")


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """(folder, {media path relative to it: the members its sample must hold}, the skips expected by reason)."""
    base = tmp_path_factory.mktemp("media")
    root, elsewhere = str(base / "my media"), str(base / "elsewhere")
    want = {}

    def pair(rel, make, seed, caption, cap_ext="txt", member=None):
        make(os.path.join(root, rel), seed)
        _write(os.path.join(root, os.path.splitext(rel)[0] + "." + cap_ext), caption)
        with open(os.path.join(root, rel), "rb") as f:
            ext = member or os.path.splitext(rel)[1][1:].lower()
            want[rel] = {ext: f.read(), cap_ext: caption.encode()}

    jpg = lambda p, s: _image(p, s, "JPEG")  # noqa: E731
    png = lambda p, s: _image(p, s, "PNG", (64, 96))  # noqa: E731
    pair("clips/beach.mp4", _video, 1, "waves roll onto a beach")
    pair("clips/night drive.v2.mp4", _video, 2, json.dumps({"caption": "a road at night", "fps": 16}), "json")
    pair("photos/cat.JPEG", jpg, 3, "a cat on a sofa", member="jpg")
    pair("photos/dog.png", png, 4, json.dumps({"prompt": "a dog in the snow"}), "json")
    pair("a/clip.jpg", jpg, 5, "the clip in a")  # the same stem in two folders
    pair("b/clip.jpg", jpg, 6, "the clip in b")
    pair("a_b.png", png, 7, "a_b at the top")    # a/b.png and a_b.png sanitise to one key
    pair("a/b.png", png, 8, "b inside a")
    pair("photos/sun.jpg", jpg, 9, "the sun")   # two media of one stem: two samples, one caption
    jpg(os.path.join(root, "photos/sun.png"), 10)
    want["photos/sun.png"] = {"png": open(os.path.join(root, "photos/sun.png"), "rb").read(), "txt": b"the sun"}
    pair("photos/both.jpg", jpg, 18, "the txt is the caption; the json's metadata is kept")
    _write(os.path.join(root, "photos/both.json"), '{"fps": 16}')
    want["photos/both.jpg"]["json"] = b'{"fps": 16}'
    pair("photos/dup.jpg", jpg, 11, "the upper-case caption sorts first")
    os.rename(os.path.join(root, "photos/dup.txt"), os.path.join(root, "photos/dup.TXT"))
    _write(os.path.join(root, "photos/dup.txt"), "a second txt caption of the same stem")
    jpg(os.path.join(root, "store/near.bin"), 12)  # a link to a file inside the folder is followed
    os.makedirs(os.path.join(root, "linked"))
    os.symlink(os.path.join(root, "store/near.bin"), os.path.join(root, "linked/near.jpg"))
    _write(os.path.join(root, "linked/near.txt"), "a linked file")
    want["linked/near.jpg"] = {"jpg": open(os.path.join(root, "store/near.bin"), "rb").read(),
                               "txt": b"a linked file"}
    # links to files outside the folder are skipped unread: a private key as media, a credentials file as caption
    _write(os.path.join(elsewhere, "id_rsa"), SECRET)
    _write(os.path.join(elsewhere, "credentials"), SECRET)
    os.symlink(os.path.join(elsewhere, "id_rsa"), os.path.join(root, "linked/key.jpg"))      # link_outside
    _write(os.path.join(root, "linked/key.txt"), "a caption for the linked key")             # no_media
    jpg(os.path.join(root, "linked/creds.jpg"), 19)                                          # missing_caption
    os.symlink(os.path.join(elsewhere, "credentials"), os.path.join(root, "linked/creds.txt"))  # link_outside
    # what must be skipped
    jpg(os.path.join(root, "photos/lonely.jpg"), 13)                                    # missing_caption
    _write(os.path.join(root, "photos/orphan.json"), '{"caption": "no media"}')          # no_media
    _write(os.path.join(root, "notes/readme.txt"), "notes")                              # no_media
    _write(os.path.join(root, "photos/cat.xmp"), "<xmp/>")                               # unknown_extension
    _write(os.path.join(root, "clips/beach.srt"), "1\n00:00 --> 00:01\nhi")              # unknown_extension
    _write(os.path.join(root, "photos/blank.png"), b"")                                 # empty_file
    _write(os.path.join(root, "photos/blank.txt"), "a blank image")
    jpg(os.path.join(root, "photos/quiet.jpg"), 14)                                     # empty_caption
    _write(os.path.join(root, "photos/quiet.txt"), "  \n")
    jpg(os.path.join(root, "photos/nofield.jpg"), 15)                                   # empty_caption
    _write(os.path.join(root, "photos/nofield.json"), '{"fps": 16}')
    jpg(os.path.join(root, "photos/binary.jpg"), 16)                                    # unreadable_caption
    _write(os.path.join(root, "photos/binary.txt"), b"\xff\xfe\x00\x81 not utf-8")
    jpg(os.path.join(root, "photos/listy.jpg"), 17)                                     # unreadable_caption
    _write(os.path.join(root, "photos/listy.json"), "[1, 2]")
    os.symlink(os.path.join(root, "nowhere.jpg"), os.path.join(root, "photos/gone.jpg"))  # unreadable
    _write(os.path.join(root, ".DS_Store"), b"\0\0")                                    # hidden
    _write(os.path.join(root, "photos/._cat.JPEG"), b"\0\5\x16\7")                      # hidden
    os.symlink(elsewhere, os.path.join(root, "outside"))                                # link_outside
    os.symlink(root, os.path.join(root, "a/loop"))                                      # link_loop
    os.symlink(os.path.join(root, "b"), os.path.join(root, "b again"))                  # link_loop
    want["photos/dup.jpg"]["txt"] = b"the upper-case caption sorts first"
    skips = Counter(missing_caption=2, no_media=3, unknown_extension=3, empty_file=1, empty_caption=2,
                    unreadable_caption=2, unreadable=1, hidden=2, link_outside=3, link_loop=2, duplicate_caption=1)
    return root, want, skips


def read_shards(shards):
    """{key: {ext: bytes}} of every sample in the shards; fails on a key seen twice."""
    samples, names = {}, []
    for path in shards:
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                names.append(m.name)
                key, ext = split_name(m.name)
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
    assert len(names) == len(set(names)), "a member is written twice"
    return samples


def by_media(samples):
    """{sha1 of the media member: sample}: the fixture's media files are all different."""
    out = {}
    for s in samples.values():
        (media,) = [e for e in s if e not in ("txt", "json")]
        out[hashlib.sha1(s[media]).hexdigest()] = s
    return out


def test_every_pair_once_byte_for_byte_and_skips_counted(media, tmp_path):
    root, want, skips = media
    res = pack_folder(root, str(tmp_path / "out"), maxcount=5)
    samples = read_shards(res.shards)
    assert len(samples) == len(want) == res.samples == 13
    got = by_media(samples)
    assert got == {hashlib.sha1(next(iter(m.values()))).hexdigest(): m for m in want.values()}
    assert res.kinds == Counter(image=11, video=2)
    assert all(re.fullmatch(r"[\w\-]+", k) for k in samples), sorted(samples)
    # keys from the path: the same stem in two folders and a sanitising collision both survive
    assert {"a_clip", "b_clip", "clips_night_drive_v2", "photos_cat", "a_b"} <= set(samples)
    digest = hashlib.sha1(b"a_b.png").hexdigest()[:8]
    assert f"a_b_{digest}" in samples and samples["a_b"]["txt"] == b"b inside a"  # a/b.png sorts first
    # maxcount 5: ⌈13 / 5⌉ shards, full but the last, named shard-%05d.tar in order
    assert [os.path.basename(p) for p in res.shards] == [f"shard-{i:05d}.tar" for i in range(3)]
    assert [len(read_shards([p])) for p in res.shards] == [5, 5, 3]
    assert res.skip_counts == skips
    with open(tmp_path / "out" / PACK_SKIPPED_FILE) as f:
        listed = [json.loads(line) for line in f]
    assert Counter(k["reason"] for k in listed) == skips
    where = {k["path"]: k["reason"] for k in listed}
    assert where["photos/lonely.jpg"] == "missing_caption" and where["photos/binary.jpg"] == "unreadable_caption"
    assert where["outside"] == "link_outside" and where["photos/dup.txt"] == "duplicate_caption"
    assert where["a/loop"] == where["b again"] == "link_loop" and where["photos/blank.png"] == "empty_file"
    assert where["linked/key.jpg"] == where["linked/creds.txt"] == "link_outside"
    assert where["linked/creds.jpg"] == "missing_caption"
    # nothing of a link's target is packed or written down
    written = [open(p, "rb").read() for p in res.shards] + [open(tmp_path / "out" / PACK_SKIPPED_FILE, "rb").read()]
    assert not any(SECRET[:12] in b or b"AKIAEXAMPLE" in b for b in written)


def test_shards_index_with_data_raw(media, tmp_path):
    root, want, _ = media
    out = str(tmp_path / "out")
    res = pack_folder(root, out, maxcount=5)
    index = index_corpus(res.shards, out, TINY, RawConfig())
    assert len(index.records) == len(want) and index.meta["skipped"] == {}
    assert all(r["bucket"] is not None for r in index.records)
    assert Counter(r["bucket"] for r in index.records) == Counter(img_64=8, img_64x96=3, vid_64_9f=2)
    captions = sorted(read_caption(index, i) for i in range(len(index.records)))
    expected = []
    for m in want.values():
        ext = "txt" if "txt" in m else "json"
        expected.append(parse_caption(m[ext], ext)[0])
    assert captions == sorted(expected) and "a dog in the snow" in captions


def test_maxsize_splits_and_packing_is_reproducible(media, tmp_path):
    root, want, _ = media
    one = pack_folder(root, str(tmp_path / "one"), maxsize=1)  # every shard closes after its first sample
    assert len(one.shards) == len(want)
    again = pack_folder(root, str(tmp_path / "again"), maxsize=1)
    assert [_sha(p) for p in one.shards] == [_sha(p) for p in again.shards]


def test_refuses_existing_shards_unless_overwrite(media, tmp_path):
    root, want, _ = media
    out = str(tmp_path / "out")
    first = pack_folder(root, out, maxcount=3)
    before = {p: _sha(p) for p in first.shards}
    with pytest.raises(ValueError, match="--overwrite"):
        pack_folder(root, out, maxcount=100)
    assert {p: _sha(p) for p in glob.glob(os.path.join(out, "shard-*.tar"))} == before
    index_corpus(first.shards, out, TINY, RawConfig())
    second = pack_folder(root, out, maxcount=100, overwrite=True)
    # the five earlier shards and their index are gone: shard-*.tar names exactly the new corpus
    assert glob.glob(os.path.join(out, "shard-*.tar")) == second.shards and len(second.shards) == 1
    assert not os.path.exists(os.path.join(out, "index.jsonl"))
    assert len(read_shards(second.shards)) == len(want)


def test_arguments_are_checked(media, tmp_path):
    root, _, _ = media
    with pytest.raises(ValueError, match="--maxcount"):
        pack_folder(root, str(tmp_path / "o"), maxcount=0)
    with pytest.raises(ValueError, match="--maxsize-mb"):
        pack_folder(root, str(tmp_path / "o"), maxsize=0)
    with pytest.raises(ValueError, match="--out"):
        pack_folder(root, root)
    with pytest.raises(ValueError, match="FOLDER"):
        pack_folder(str(tmp_path / "missing"), str(tmp_path / "o"))
    empty = tmp_path / "empty"
    _write(str(empty / "only.txt"), "a caption without media")
    res = pack_folder(str(empty), str(tmp_path / "e"))
    assert res.samples == 0 and res.shards == [] and not glob.glob(str(tmp_path / "e" / "*.tar"))
    assert res.skip_counts == Counter(no_media=1)


def test_output_inside_the_folder_is_not_packed(media, tmp_path):
    root, want, _ = media
    work = tmp_path / "work"
    _image(str(work / "x.jpg"), 20, "JPEG")
    _write(str(work / "x.txt"), "x")
    _image(str(work / "shards" / "stray.jpg"), 21, "JPEG")  # a pair inside --out is not input either
    _write(str(work / "shards" / "stray.txt"), "stray")
    first = pack_folder(str(work), str(work / "shards"))
    assert first.samples == 1 and first.skip_counts == Counter()
    second = pack_folder(str(work), str(work / "shards"), overwrite=True)
    assert second.samples == 1 and second.skip_counts == Counter()  # its own shards and lists are not input


@pytest.mark.slow
def test_cli(media, tmp_path):
    root, want, skips = media
    script = os.path.join(ROOT, "scripts", "pack_media.py")
    run = lambda *a: subprocess.run([sys.executable, script, *a], capture_output=True, text=True, cwd=ROOT)  # noqa
    h = run("--help")
    assert h.returncode == 0 and "pack_media.py ~/my_clips --out" in h.stdout and "--maxsize-mb" in h.stdout
    out = str(tmp_path / "out, packed")  # a comma: Hydra must get the path quoted
    r = run(root, "--out", out, "--maxcount", "5", "--index")
    assert r.returncode == 0, r.stderr
    assert f"packed {len(want)} samples (11 images, 2 videos)" in r.stdout and "3 shard(s)" in r.stdout
    assert f"skipped {sum(skips.values())} file(s)" in r.stdout and "link_outside" in r.stdout
    assert b"AKIAEXAMPLE" not in (r.stdout + r.stderr).encode()
    with open(os.path.join(out, "index.jsonl")) as f:
        assert sum(1 for line in f if line.strip()) == len(want)
    # the printed command, as the shell and Hydra read it, names exactly the shards written
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from data.raw import expand_urls

    line = r.stdout.strip().splitlines()[-1].strip()
    argv = shlex.split(line)
    assert argv[:2] == ["python", "train.py"] and len(argv) == 3
    urls = OverridesParser.create().parse_override(argv[2]).value()
    assert expand_urls(urls) == sorted(glob.glob(os.path.join(glob.escape(out), "shard-*.tar"))) != []
    again = run(root, "--out", out)
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()
