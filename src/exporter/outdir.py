"""The output folder: staged, locked, atomically published.

A run writes into a hidden staging folder beside the output folder and renames
it into place only when every file, ``manifest.json`` last, is written. So the
output folder is either complete or absent; an interrupted run leaves no
manifest behind. A lock file beside the output folder makes a second run into
the same folder fail at once instead of mixing two runs. An existing output
folder is replaced only with ``overwrite``.

Every file a run writes goes through :func:`write_atomic` (a temporary name, then a rename) or the tensor
writers here; :func:`sha256_file` is the one hash of the manifest, ``verify`` and the caches; :func:`public_path`,
:func:`public_command` and :func:`model_name` keep this machine's folders and its user's name out of what is
published.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

from . import interrupts
from .dtypes import name_of, safetensors_code
from .errors import OutputError
from .supervisor import report


def sha256_file(path: Path, chunk: int = 8 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            block = handle.read(chunk)
            if not block:
                break
            digest.update(block)
    return digest.hexdigest()


def file_entry(path: Path, root: Path) -> dict[str, Any]:
    """A file of the output folder as the report and the manifest list it."""
    return {"path": str(Path(path).relative_to(root)), "sha256": sha256_file(path), "bytes": Path(path).stat().st_size}


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` completely or not at all (temp file, fsync, rename)."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise os_problem(exc, path) from None
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise os_problem(exc, path) from None


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=2, sort_keys=False, default=str) + "\n")


WRITE_CHUNK_BYTES = 64 * 2**20


def save_tensors(path: Path, samples: list[list[Any]], names: tuple[str, ...]) -> None:
    """Samples (lists of tensors in ``names`` order) as one safetensors file, keys ``<sample>.<name>``.

    Written tensor by tensor in slices, from wherever the tensors are (a GPU included): the host holds one
    slice at a time, never the whole file (float64 logits of a large vocabulary are gigabytes).
    """
    entries = [(f"{i}.{name}", t) for i, sample in enumerate(samples) for name, t in zip(names, sample)]
    save_named_tensors(path, entries)


def save_named_tensors(path: Path, entries: list[tuple[str, Any]]) -> None:
    """``(name, tensor)`` pairs as one safetensors file, written in slices from wherever the tensors are."""
    import torch  # noqa: PLC0415 - the command line reads recipes (and their paths) without torch

    entries = [(key, tensor.detach()) for key, tensor in entries]
    header: dict[str, Any] = {}
    offset = 0
    for key, tensor in entries:
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": safetensors_code(name_of(tensor.dtype)),
                       "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "wb") as handle:
            handle.write(struct.pack("<Q", len(raw)))
            handle.write(raw)
            for _, tensor in entries:
                flat = tensor.reshape(-1)
                step = max(WRITE_CHUNK_BYTES // max(tensor.element_size(), 1), 1)
                for start in range(0, flat.numel(), step):
                    piece = flat[start:start + step].to("cpu").contiguous()
                    handle.write(piece.view(torch.uint8).numpy().data)
    except OSError as exc:
        if disk_full(exc) is not None:
            raise  # the caller names the output folder, not a file of its staging folder
        raise os_problem(exc, path) from None


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(exc: BaseException) -> OSError | None:
    """The OSError that says the disk (or quota, or file size limit) is full, anywhere in ``exc``'s chain."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL:
            return current
        if "No space left on device" in str(current) or "Disk quota exceeded" in str(current):  # wrapped by a library
            return OSError(errno.ENOSPC, "No space left on device")
        current = current.__cause__ or current.__context__
    return None


def os_problem(exc: OSError, path: Path) -> OutputError:
    """An ``OSError`` writing ``path`` as the one-line problem a user can act on."""
    if exc.errno in DISK_FULL:
        return OutputError(f"the disk filled up while writing {path} ({exc.strerror})",
                           "free disk space or choose another --out")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"cannot write {path}: {exc.strerror}", "choose a writable --out folder")
    return OutputError(f"cannot write {path}: {exc.strerror or exc}", "check the --out folder")


def public_path(path: str | Path) -> str:
    """A path as a published report may show it: relative to the working folder when inside it, else only
    its name, so a report names no host's folders (nor the user whose home they are in)."""
    text = str(path)
    given = Path(text)
    if not given.is_absolute() and ".." not in given.parts:
        return text
    try:
        return str(given.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return given.name or text


def path_from(folder: Path, target: str | Path) -> str:
    """``target`` as a path relative to ``folder`` (an output folder pointing at its checkpoint), so that it
    still resolves when both move together; only the name when they share no folder but the root, where a
    relative path would spell out the whole tree (a home folder, a user name)."""
    folder, target = Path(folder).resolve(), Path(target).resolve()
    common = Path(os.path.commonpath([folder, target]))
    relative = os.path.relpath(target, folder)
    if common == Path(common.anchor) or _names_someone(Path(relative).parts):
        return target.name
    return relative


def _names_someone(parts: tuple[str, ...]) -> bool:
    """Whether a path's parts name this user or this host (a path across home folders would)."""
    import getpass  # noqa: PLC0415 - only where a path is made public
    import platform  # noqa: PLC0415

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = ""
    return any(part in (user, platform.node()) for part in parts if part)


def public_command(argv: list[str]) -> list[str]:
    """The command line as typed, with every argument that is an absolute path or names an existing file or
    folder made public (:func:`public_path`)."""
    shown = []
    for arg in argv:
        option, eq, value = arg.partition("=") if arg.startswith("-") and "=" in arg else ("", "", arg)
        if value and (os.path.isabs(value) or os.path.exists(value)):
            value = public_path(value)
        shown.append(f"{option}{eq}{value}")
    return shown


GENERIC_NAMES = {"model", "models", "checkpoint", "checkpoints", "weights", "snapshot", "final", "pytorch_model"}


def model_name(path: Path) -> str:
    """A folder name for the model: the file's stem, or its folder's name when the stem says nothing."""
    path = Path(path).resolve()
    folder = path if path.is_dir() else path.parent
    name = path.name.split(".")[0] if path.is_file() else path.name
    generic = name.lower() in GENERIC_NAMES or name.startswith("model-") or path.name.endswith(".index.json")
    if path.is_file() and generic:
        name = folder.name
    if name.lower() in GENERIC_NAMES and folder.parent != folder:
        name = (folder.parent if name == folder.name else folder).name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


# the checkpoint's files that make an output folder a model folder, copied beside the artifacts, so tools that
# read a folder (AutoTokenizer/AutoConfig.from_pretrained(OUT), Optimum's ORTModel, pipelines) find them
MODEL_FOLDER_FILES = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "source.spm", "target.spm", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json", "normalizer.json",
)


def copy_model_files(root: Path, staging: Path) -> list[str]:
    """Copy each of :data:`MODEL_FOLDER_FILES` that the checkpoint folder ``root`` holds into ``staging``; the
    names copied."""
    copied = []
    for name in MODEL_FOLDER_FILES:
        source = root / name
        if source.is_file() and not (staging / name).exists():
            shutil.copyfile(source, staging / name)
            copied.append(name)
    return copied


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` is an output folder an exporter run published: its ``manifest.json`` is one."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "schema_version" in manifest and isinstance(manifest.get("files"), list)


def checkpoint_guard(checkpoint: Path) -> tuple[Path, bool]:
    """What an output folder must keep clear of: a checkpoint folder (the folder itself, ``True``: nothing may go
    inside it either), or a checkpoint file (the file, ``False``: a folder beside it is fine, one holding it is not)."""
    path = Path(checkpoint).resolve()
    return path, path.is_dir()


def lock_file(path: Path, busy: OutputError) -> int:
    """An open descriptor of ``path`` (made if missing) holding its exclusive lock; ``busy`` is raised where another
    process holds it, and an ``OSError`` opening or locking it propagates (nothing left open)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise busy from None
    except OSError:
        os.close(fd)
        raise
    return fd


class OutputFolder:
    """Stage files for ``final``; ``publish()`` moves them into place; ``discard()`` removes them.

    ``--overwrite`` only ever replaces a folder an earlier run published (:func:`holds_run`); ``keep_clear``
    (the checkpoint) refuses an output folder that is it, holds it or, for a checkpoint folder, lies inside it.
    Staging folders that dead runs left beside ``final`` are removed once this run holds the lock (a live run
    holds it while it writes).
    """

    def __init__(self, final: Path, overwrite: bool = False, keep_clear: Path | None = None):
        self.final = Path(final).resolve()
        self.overwrite = overwrite
        self.keep_clear = checkpoint_guard(keep_clear) if keep_clear is not None else None
        self.lock_path = self.final.parent / f".{self.final.name}.lock"
        self.staging: Path | None = None
        self._lock_fd: int | None = None
        self.removed_stale: list[str] = []  # staging folders of dead runs this run removed

    def __enter__(self) -> "OutputFolder":
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
        self.release()

    def _check_clear(self) -> None:
        if self.keep_clear is None:
            return
        guarded, is_folder = self.keep_clear
        final = self.final
        if final == guarded or guarded.is_relative_to(final):
            raise OutputError(f"output folder {final} {'is' if final == guarded else 'holds'} the checkpoint "
                              f"{guarded}: replacing it would delete the checkpoint",
                              "choose an --out outside the checkpoint's folder")
        if is_folder and final.is_relative_to(guarded):
            raise OutputError(f"output folder {final} lies inside the checkpoint folder {guarded}: the artifacts "
                              "would mix with the checkpoint's files",
                              "choose an --out outside the checkpoint's folder")

    def open(self) -> Path:
        self._check_clear()
        if self.final.exists() and not self.final.is_dir():
            raise OutputError(f"output path {self.final} exists and is not a folder", "choose another --out")
        if self.final.is_dir() and any(self.final.iterdir()):
            if not holds_run(self.final):
                raise OutputError(f"output folder {self.final} holds files that are not an exporter run (no "
                                  "manifest.json)", "choose another --out: --overwrite only replaces a folder "
                                  "an earlier run published")
            if not self.overwrite:
                raise OutputError(f"output folder {self.final} already holds a run",
                                  "pass --overwrite to replace it, or choose another --out")
        try:
            self.final.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_problem(exc, self.final.parent) from None
        if not os.access(self.final.parent, os.W_OK):
            raise OutputError(f"output folder {self.final.parent} is not writable", "choose a writable --out folder")
        self._lock()
        self._remove_stale()
        try:
            self.staging = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.partial-", dir=self.final.parent))
            report("staging", self.staging)  # a supervising parent removes it if this process dies
            os.chmod(self.staging, 0o777 & ~umask())
        except OSError as exc:
            self.release()
            raise os_problem(exc, self.final.parent) from None
        return self.staging

    def _lock(self) -> None:
        """Hold the lock file beside ``final``. Its holder removes it on release, so a file locked after its holder
        removed it is no longer the lock: take the one now at ``lock_path`` instead."""
        for _ in range(100):
            try:
                fd = lock_file(self.lock_path, OutputError(f"another exporter run is writing {self.final}",
                                                           "wait for it to finish, or choose another --out"))
            except OSError as exc:
                raise os_problem(exc, self.lock_path) from None
            try:
                held, there = os.fstat(fd), os.stat(self.lock_path)
                current = (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)
            except FileNotFoundError:
                current = False
            if current:
                self._lock_fd = fd
                return
            os.close(fd)  # its holder removed it while this run waited on it: lock the new one
        raise OutputError(f"the lock file {self.lock_path} keeps being replaced", "choose another --out")

    def _remove_stale(self) -> None:
        """Staging and old folders of earlier runs into ``final`` that ended without cleaning up (killed, or a
        crash): whoever made them held this lock while they lived, so under it they are all dead."""
        for prefix in (f".{self.final.name}.partial-", f".{self.final.name}.old-"):
            for leftover in self.final.parent.glob(prefix + "*"):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover, ignore_errors=True)
                    self.removed_stale.append(leftover.name)

    @property
    def staged(self) -> Path:
        """The staging folder of an open output folder."""
        if self.staging is None:
            raise RuntimeError("the output folder is not open (use it as a context manager)")
        return self.staging

    def publish(self) -> Path:
        """Replace the output folder with the staged one (the old run, if any, is removed first).

        Never after SIGINT or SIGTERM: a run its operator stopped must not look finished."""
        assert self.staging is not None
        interrupts.check()
        if self.final.exists():
            trash = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
            os.replace(self.final, trash)
            os.replace(self.staging, self.final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.staging, self.final)
        self.staging = None
        return self.final

    def discard(self) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    def release(self) -> None:
        """Remove the lock file, then let it go (removed while held: a run that opened it meanwhile sees it is no
        longer the lock, in :meth:`_lock`)."""
        if self._lock_fd is not None:
            try:
                try:
                    os.unlink(self.lock_path)
                except OSError:
                    pass
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
            finally:
                self._lock_fd = None
