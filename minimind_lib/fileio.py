"""Atomic file writes (memmaps of notebook 02_data, checkpoints of 03_model): old file or new, never
half of one; and the lock that keeps a second run of notebook 07_pretrain's pipeline out of a run
directory in use."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

try:
    import fcntl
# Windows: no advisory locks; a second run into the same directory is not detected there
except ImportError:
    fcntl = None

# Every file this program leaves beside a user's starts with PREFIX: never mistaken for theirs, nor
# removed as ours.
PREFIX = ".minimind-"
LOCK_FILE, TMP_PREFIX = PREFIX + "lock", PREFIX + "tmp."
# What an OSError's errno means and what to do: the commands' error line, never a bare [Errno N]
ADVICE = {
    errno.EACCES: "permission denied: this user may not write (or read) there; choose another "
                  "folder or change its permissions",
    errno.EROFS: "the file system is read-only: choose a folder on a writable disk",
    errno.EISDIR: "is a folder where a file is needed: move it away or choose another path",
    errno.ENOSPC: "no space left on the disk: free some space or choose another disk",
    errno.EDQUOT: "the disk quota is exceeded: free some space or choose another disk",
    errno.EFBIG: "the file-size limit (ulimit -f) was reached",
    errno.ENAMETOOLONG: "the name is too long for the file system",
}
ADVICE[errno.EPERM] = ADVICE[errno.EACCES]


def explain(error: BaseException) -> str:
    """An error as one line naming the path and what to do: an OSError's errno in words (ADVICE),
    else its text."""
    if not isinstance(error, OSError) or error.errno not in ADVICE:
        return str(error)
    if error.filename is None:  # no path to name: the system's words, then what to do
        return f"{error.strerror}: {ADVICE[error.errno]}"
    return f"{os.fsdecode(error.filename)}: {ADVICE[error.errno]}"


def check_utf8_path(path: str | os.PathLike, flag: str) -> None:
    """Refuse a path whose name is not UTF-8 text: a run's JSON files record it, text only."""
    try:
        os.fsdecode(path).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{flag} {os.fsencode(path)!r}: the name holds bytes that are not UTF-8 "
                         f"text, which the run's JSON files cannot record; choose a name in "
                         f"UTF-8") from None


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb",
                encoding: str | None = None) -> Iterator[IO]:
    """Open a temp file beside `path` for writing; on success flush, fsync and os.replace it onto
    `path`."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{TMP_PREFIX}{path.name}."
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
    except OSError as e:  # a read-only folder: name the file to write, not the temp file's
        raise type(e)(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, mode, encoding=encoding if mode == "w" else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes 0600; the files we write are meant to be read by others
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        while e is not None and getattr(e, "errno", None) not in (errno.ENOSPC, errno.EDQUOT,
                                                                  errno.EFBIG):
            # torch.save reports a failed write as "unexpected pos ..."
            e = e.__cause__ or e.__context__
        if e is None:
            raise
        why = (
            "the file-size limit (ulimit -f) was reached"
            if e.errno == errno.EFBIG
            else "no space left on the disk"
        )
        raise OSError(f"cannot write {path}: {why}; the partial file was removed"
                      + (f", the previous {path.name} is unchanged" if path.exists()
                         else "")) from None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


@contextlib.contextmanager
def exclusive_dir(directory: str | os.PathLike) -> Iterator[Path]:
    """Hold an exclusive lock on a directory for the block (another holder: FileExistsError naming
    its pid, kept in DIR/.minimind-lock meanwhile). A directory created here and left empty is
    removed at the end."""
    directory = Path(directory)
    if directory.is_symlink() and not directory.exists():
        raise FileExistsError(f"{directory} is a symbolic link to {os.readlink(directory)}, which "
                              "does not exist: "
                              f"create its target or choose another directory")
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} is a file, not a directory")
    created, pid_file = not directory.exists(), directory / LOCK_FILE
    directory.mkdir(parents=True, exist_ok=True)
    # the lock is on the directory itself: a kill leaves nothing locked
    fd = os.open(directory, os.O_RDONLY)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        if pid_file.is_file():
            holder = pid_file.read_text().strip()
        else:
            holder = ""
        raise FileExistsError(f"{directory} is in use by pid {holder or '?'} (another run writes "
                              "there); wait for "
                              f"it to end or choose another directory") from None
    try:
        pid_file.write_text(str(os.getpid()))
        yield directory
    finally:
        pid_file.unlink(missing_ok=True)
        if created and not any(directory.iterdir()):
            directory.rmdir()
        os.close(fd)


def file_fingerprint(path: str | os.PathLike) -> dict:
    """Size and SHA-1 of the whole content, streamed (benchmarks/memmap.py measures it on 1 GB): the
    tokenizer cache and the resume check both use it, so they cannot disagree about whether a data
    file changed."""
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
        return {"size": f.tell(), "sha1": digest.hexdigest()}
