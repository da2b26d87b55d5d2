"""The rules for files exporter did not make (docs/check.md, "Threat model").

``exporter check`` judges what another tool or person produced, often in a CI job with credentials, and
``exporter verify`` re-runs what such a folder holds. Both treat every byte they are handed as untrusted:

* **Names inside a file stay inside its folder.** An ONNX external-data location, an artifact path in a
  ``report.json`` or an ``export.json`` must be a plain relative path: no absolute path, no ``..``, no drive
  (:func:`relative_name`), refused before anything runs.
* **Every file read lies inside the judged folder** once its symlinks are followed (:class:`Folder`); the one
  exception is a hub cache's snapshot, whose files link into that repository's own ``blobs/``. A file outside is
  refused, never copied, hashed or published.
* **Copies, never hard links** (:func:`copy_in`): a hard link would tie the published folder to the user's file
  (re-saving it in place would change what was judged) and makes ``onnx.load`` refuse both as a possible hard-link
  attack. A reflink is used where the file system offers one.
* **Nothing is executed without an opt-in**: an AOTInductor package is a shared library
  (:func:`refuse_native_code`), a ``.pt2`` that needs a pickle is the pickle's code
  (``targets.program_file``), and the modules a program's call spec names are imported only from an allow-list of
  transformers' ModelOutput modules (:func:`spec_module_allowed`), never from the working folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path, PurePosixPath, PureWindowsPath

from ..errors import UsageError
from ..modelio import SPEC_MODULES

NATIVE_FIX = ("pass --allow-native-code (recipe: [trust] native_code = true) only if you trust whoever compiled it, "
              "or check its .pt2 program or ONNX export instead")

def spec_module_allowed(module: str) -> bool:
    """Whether a call spec's type may be registered by importing ``module``: transformers' ModelOutput modules
    only (their classes register their pytree node when imported); nothing else is imported."""
    return bool(SPEC_MODULES.match(module))


def relative_name(name: str, where: str) -> PurePosixPath:
    """``name``, read from ``where`` (a file of the judged folder), as a relative path that cannot leave the folder;
    a UsageError naming both otherwise."""
    text = str(name)
    posix, windows = PurePosixPath(text.replace("\\", "/")), PureWindowsPath(text)
    if not text or "\x00" in text or posix.is_absolute() or windows.drive or windows.root or ".." in posix.parts:
        raise UsageError(f"{where} names the file {text!r}, a path outside its own folder",
                         "export again so that every file it names lies beside it (no absolute or ../ paths)")
    return posix


class Folder:
    """The folder being judged, and where its files may really lie (symlinks followed)."""

    def __init__(self, given: Path):
        self.given = Path(os.path.abspath(given))
        self.base = self.given if self.given.is_dir() else self.given.parent
        self.roots = [Path(os.path.realpath(self.base))]
        for folder in [self.roots[0], *self.roots[0].parents]:  # a hub cache: snapshots/<rev>/[sub/]x -> blobs/<sha>
            if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
                self.roots.append(Path(os.path.realpath(folder.parent.parent / "blobs")))
                break

    def check(self, file: Path) -> Path:
        """``file`` as it lies beside the others (unresolved); a UsageError where it leaves the folder."""
        plain = Path(os.path.abspath(file))
        if plain == self.given and self.given.is_file():
            return plain  # the file the user named: wherever its link points, they chose it
        try:
            plain.relative_to(self.base)
        except ValueError:
            raise UsageError(f"{plain} lies outside the judged folder {self.base}",
                             "copy the artifact and every file it reads into one folder, and check that") from None
        real = Path(os.path.realpath(plain))
        if not any(real == root or root in real.parents for root in self.roots):
            raise UsageError(f"{plain.relative_to(self.base)} in {self.base} is a link to {real}, outside the judged "
                             "folder: exporter does not read, copy or publish files from elsewhere",
                             "replace the link with the file itself, or check the folder the link points into")
        return plain

    def check_described(self) -> None:
        """The files a folder is described from (its models and its JSON) lie in it: checked before any is read."""
        if not self.given.is_dir():
            return
        for file in self.given.iterdir():
            if file.is_symlink() and (file.suffix in (".onnx", ".pt2", ".json") or file.name.endswith(".onnx.data")):
                self.check(file)

    def check_opened(self, file: Path, descriptor: int) -> None:
        """The file open at ``descriptor`` (opened as ``file``) lies in the folder: its real path, read from the
        descriptor itself where the system says it (``/proc/self/fd``)."""
        opened = Path(f"/proc/self/fd/{descriptor}")
        if not opened.exists() or Path(os.path.abspath(file)) == self.given:
            return
        real = Path(os.path.realpath(opened))
        if not any(real == root or root in real.parents for root in self.roots):
            raise UsageError(f"{file} was opened as {real}, outside the judged folder {self.base} (changed while "
                             "being read)", "check a folder that nothing else writes to while it is judged")

    def inside(self, file: Path) -> Path:
        """``file``'s path relative to the judged folder (checked)."""
        return self.check(file).relative_to(self.base)


def copy_in(source: Path, target: Path, folder: Folder | None = None) -> None:
    """Copy ``source`` (its symlinks followed) to ``target``: a reflink where the file system shares blocks
    copy-on-write, else a plain copy; never a hard link. With ``folder``, the file actually opened must lie in it
    (a link swapped after the folder was checked is caught here)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src:
        if folder is not None:
            folder.check_opened(source, src.fileno())
        _copy_open(src, target)


def _copy_open(src, target: Path) -> None:
    with open(target, "wb") as dst:
        with contextlib.suppress(OSError, ImportError, AttributeError):
            import fcntl  # noqa: PLC0415 - POSIX only

            fcntl.ioctl(dst.fileno(), 0x40049409, src.fileno())  # FICLONE
            return
        shutil.copyfileobj(src, dst, 1 << 22)


def refuse_native_code(names: list[str], allowed: bool) -> None:
    """A UsageError for the AOTInductor packages in ``names`` unless native code is ``allowed``."""
    if names and not allowed:
        listed = ", ".join(names)
        raise UsageError(f"{listed} {'is an AOTInductor package' if len(names) == 1 else 'are AOTInductor packages'}: "
                         "judging it loads a shared library from the file, which runs its native code", NATIVE_FIX)


__all__ = ["Folder", "NATIVE_FIX", "copy_in", "refuse_native_code", "relative_name", "spec_module_allowed"]
