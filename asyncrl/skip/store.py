"""Dumps on disk: one directory per (experiment, role, shape, step), written atomically.

Layout::

    <dump_dir>/<experiment>/<role>/<shape_key>/shape.json          what the shape key stands for
    <dump_dir>/<experiment>/<role>/<shape_key>/step_<N>/meta.json  the commit record
    <dump_dir>/<experiment>/<role>/<shape_key>/step_<N>/data-<sha256[:16]>.bin

The data file holds the value encoded with the project's codec (`asyncrl.queue.pack`, no
pickle): a small frame table, then the codec's frames, each 16-byte aligned so decoded arrays
are aligned views on the file's bytes. ``meta.json`` names the data file and carries its size
and SHA-256, the experiment, the role, the shape and the step. A dump is valid only when both
exist and agree.

Writing is crash-safe: the data goes to a temporary file that is fsynced, then, under an
exclusive lock on the step directory, renamed to its content-addressed name, and ``meta.json``
(also written to a temporary file and fsynced) is renamed over the old one last. A writer
killed at any point leaves either the previous valid dump or none (leftover temporary files
are ignored by readers), and two writers of one step commit one after the other, each leaving
a dump whose meta names its own data.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("asyncrl.skip")

FORMAT = 1
_MAGIC = b"ASRLDUMP"
_HEAD = struct.Struct("<8sII")  # magic, format, number of frames
_ALIGN = 16


class DumpError(RuntimeError):
    """A dump that exists but cannot be used; the message says why."""


@dataclass(frozen=True)
class DumpKey:
    """Which dumps a run may load: same experiment, role and shape."""

    experiment: str
    role: str
    shape: dict
    """Everything that makes a result reusable (model, data, n, token budget, sampling...)."""

    @property
    def shape_key(self) -> str:
        return shape_key(self.shape)


def shape_key(shape: dict) -> str:
    """16 hex digits of the SHA-256 of the shape's canonical JSON."""
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


class DumpStore:
    """Reads and writes the dumps of one `DumpKey` under ``root``."""

    def __init__(self, root: str | os.PathLike, key: DumpKey):
        self.key = key
        self.base = Path(root) / key.experiment / key.role
        self.dir = self.base / key.shape_key

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step_{step}"

    # ------------------------------------------------------------------ write

    def write(self, step: int, value: Any) -> Path:
        """Dump ``value`` (anything the codec encodes) for ``step``; returns the data file's path."""
        from asyncrl.queue import pack

        frames = [_as_bytes(f) for f in pack(value)]
        sdir = self.step_dir(step)
        sdir.mkdir(parents=True, exist_ok=True)
        self._write_shape_once()
        token = f"{os.getpid()}.{secrets.token_hex(4)}"
        tmp = sdir / f".data.{token}.tmp"
        digest, size = _write_frames(tmp, frames)
        data_name = f"data-{digest[:16]}.bin"
        meta = {
            "format": FORMAT, "experiment": self.key.experiment, "role": self.key.role,
            "shape_key": self.key.shape_key, "shape": self.key.shape, "step": step,
            "data_file": data_name, "data_bytes": size, "data_sha256": digest,
            "created": time.time(), "writer_pid": os.getpid(),
        }
        meta_tmp = sdir / f".meta.{token}.tmp"
        try:
            _write_file(meta_tmp, json.dumps(meta, indent=1, sort_keys=True, default=str).encode())
            with _locked(sdir):
                os.replace(tmp, sdir / data_name)
                os.replace(meta_tmp, sdir / "meta.json")  # the commit point
                _fsync_dir(sdir)
                for other in sdir.glob("data-*.bin"):
                    if other.name != data_name:  # superseded by this commit; no valid meta names it now
                        other.unlink(missing_ok=True)
        finally:
            tmp.unlink(missing_ok=True)
            meta_tmp.unlink(missing_ok=True)
        return sdir / data_name

    def _write_shape_once(self) -> None:
        path = self.dir / "shape.json"
        if not path.exists():
            tmp = self.dir / f".shape.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            _write_file(tmp, json.dumps(self.key.shape, indent=1, sort_keys=True, default=str).encode())
            os.replace(tmp, path)

    # ------------------------------------------------------------------ read

    def meta(self, step: int) -> dict:
        """The step's ``meta.json`` after checking it belongs to this key and its data file is
        there with the announced size; raises FileNotFoundError (no dump) or `DumpError`."""
        sdir = self.step_dir(step)
        try:
            meta = json.loads((sdir / "meta.json").read_bytes())
        except json.JSONDecodeError as e:
            raise DumpError(f"{sdir / 'meta.json'} is not JSON ({e.msg})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise DumpError(f"{sdir / 'meta.json'}: format {meta.get('format') if isinstance(meta, dict) else meta!r} "
                            f"is not {FORMAT}")
        self._check_key(meta, sdir, step)
        data = sdir / str(meta.get("data_file"))
        try:
            size = data.stat().st_size
        except FileNotFoundError:
            raise DumpError(f"{sdir}: meta.json names {meta.get('data_file')!r}, which is missing") from None
        if size != meta.get("data_bytes"):
            raise DumpError(f"{data}: {size} bytes but meta.json says {meta.get('data_bytes')}")
        return meta

    def _check_key(self, meta: dict, sdir: Path, step: int) -> None:
        k = self.key
        if meta.get("experiment") != k.experiment:
            raise DumpError(f"{sdir}: dumped by experiment {meta.get('experiment')!r}, this run is {k.experiment!r}")
        if meta.get("role") != k.role or meta.get("step") != step:
            raise DumpError(f"{sdir}: holds role {meta.get('role')!r} step {meta.get('step')!r}, "
                            f"expected {k.role!r} step {step}")
        theirs = meta.get("shape")
        if meta.get("shape_key") != k.shape_key or theirs != json.loads(json.dumps(k.shape, default=str)):
            raise DumpError(f"{sdir}: another shape ({describe_shape_change(theirs, k.shape)})")

    def valid(self, step: int) -> bool:
        """Whether ``step`` has a dump that passes the cheap checks (`meta`); the hash is checked on load."""
        try:
            with _locked(self.step_dir(step), shared=True):
                self.meta(step)
            return True
        except FileNotFoundError:
            return False
        except DumpError as e:
            log.warning("skip.%s: step %d's dump is not usable: %s", self.key.role, step, e)
            return False

    def load(self, step: int) -> Any:
        """Decode the step's dump after checking its SHA-256; raises FileNotFoundError or `DumpError`."""
        from asyncrl.queue import CodecError, unpack

        # Shared lock: a writer's commit (rename data, rename meta, remove superseded data) is
        # never seen half-done.
        with _locked(self.step_dir(step), shared=True):
            meta = self.meta(step)
            path = self.step_dir(step) / meta["data_file"]
            buf = _read(path)
        digest = hashlib.sha256(buf).hexdigest()
        if digest != meta["data_sha256"]:
            raise DumpError(f"{path}: SHA-256 {digest[:16]}... does not match meta.json's {meta['data_sha256'][:16]}...")
        try:
            return unpack(_split_frames(buf, path))
        except CodecError as e:
            raise DumpError(f"{path}: not a codec value: {e}") from None

    def steps(self) -> list[int]:
        """Steps that have a ``meta.json`` under this key (not yet checked), ascending."""
        out = []
        if self.dir.is_dir():
            for d in self.dir.iterdir():
                if d.name.startswith("step_") and d.name[5:].isdigit() and (d / "meta.json").exists():
                    out.append(int(d.name[5:]))
        return sorted(out)

    def foreign(self, step: int) -> list[str]:
        """Why dumps of ``step`` under other experiments or shapes are not this run's (for the log)."""
        root = self.base.parent.parent
        out = []
        for meta_path in sorted(root.glob(f"*/{self.key.role}/*/step_{step}/meta.json")):
            if meta_path.parent.parent == self.dir:
                continue
            try:
                meta = json.loads(meta_path.read_bytes())
            except (OSError, json.JSONDecodeError):
                continue
            if meta.get("experiment") != self.key.experiment:
                out.append(f"{meta_path.parent} is experiment {meta.get('experiment')!r}, not {self.key.experiment!r}")
            else:
                out.append(f"{meta_path.parent} has another shape ({describe_shape_change(meta.get('shape'), self.key.shape)})")
        return out


def describe_shape_change(theirs: Any, ours: dict) -> str:
    """``n: 4 -> 8, max_tokens: 6 -> 8``: the fields a dump's shape has that differ from ours."""
    if not isinstance(theirs, dict):
        return f"unreadable shape {theirs!r}"
    ours = json.loads(json.dumps(ours, default=str))
    diffs = [f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in sorted(set(theirs) | set(ours))
             if theirs.get(k) != ours.get(k)]
    return ", ".join(diffs) or "same fields, another key"


# ---------------------------------------------------------------------- file helpers


def _as_bytes(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _pad(n: int) -> int:
    return -n % _ALIGN


def _write_frames(path: Path, frames: list[memoryview]) -> tuple[str, int]:
    """Frame table then 16-byte aligned frames, fsynced; returns (sha256 hex, size)."""
    h = hashlib.sha256()
    table = _HEAD.pack(_MAGIC, FORMAT, len(frames)) + struct.pack(f"<{len(frames)}Q", *(f.nbytes for f in frames))
    size = 0
    with open(path, "wb") as f:
        for chunk in (table, bytes(_pad(len(table)))):
            f.write(chunk)
            h.update(chunk)
            size += len(chunk)
        for frame in frames:
            for chunk in (frame, bytes(_pad(frame.nbytes))):
                f.write(chunk)
                h.update(chunk)
                size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest(), size


def _split_frames(buf: np.ndarray, path: Path) -> list[memoryview]:
    mv = memoryview(buf)
    if len(mv) < _HEAD.size:
        raise DumpError(f"{path}: {len(mv)} bytes is too short for a dump")
    magic, fmt, count = _HEAD.unpack_from(mv, 0)
    if magic != _MAGIC or fmt != FORMAT:
        raise DumpError(f"{path}: not a format-{FORMAT} dump (magic {magic!r}, format {fmt})")
    pos = _HEAD.size + 8 * count
    if pos > len(mv):
        raise DumpError(f"{path}: frame table runs past the end of the file")
    sizes = struct.unpack_from(f"<{count}Q", mv, _HEAD.size)
    pos += _pad(pos)
    frames = []
    for n in sizes:
        if pos + n > len(mv):
            raise DumpError(f"{path}: a frame runs past the end of the file")
        frames.append(mv[pos:pos + n])
        pos += n + _pad(n)
    if pos != len(mv):
        raise DumpError(f"{path}: {len(mv) - pos} bytes after the last frame")
    return frames


def _read(path: Path) -> np.ndarray:
    # An aligned buffer: decoded arrays are views on it.
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = np.empty(size, np.uint8)
        if f.readinto(memoryview(buf)) != size:
            raise DumpError(f"{path}: shorter than its size while reading")
    return buf


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _locked:
    """``flock`` on ``<dir>/.lock``: exclusive for a writer's commit, shared for readers (released
    by the kernel if the holder dies). A reader of a directory it cannot write, or of one that
    does not exist, goes without."""

    def __init__(self, directory: Path, shared: bool = False):
        self.path = directory / ".lock"
        self.shared = shared
        self.fd: int | None = None

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            if not self.shared:
                raise
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return self
        fcntl.flock(self.fd, fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
