"""The output folder: atomic files, no mixing of runs, a lock against concurrent runs."""

from __future__ import annotations

import pytest

from exporter.errors import OutputError
from exporter.outdir import OutputFolder, write_atomic

MANIFEST = '{"schema_version": 1, "files": []}'


def test_publish_replaces_only_with_overwrite(tmp_path):
    final = tmp_path / "out"
    with OutputFolder(final) as folder:
        write_atomic(folder.staged / "a.txt", "one")
        write_atomic(folder.staged / "manifest.json", MANIFEST)
        folder.publish()
    assert (final / "a.txt").read_text() == "one"
    with pytest.raises(OutputError, match="already holds a run.*--overwrite"):
        OutputFolder(final).open()
    with OutputFolder(final, overwrite=True) as folder:
        write_atomic(folder.staged / "b.txt", "two")
        write_atomic(folder.staged / "manifest.json", MANIFEST)
        folder.publish()
    assert sorted(p.name for p in final.iterdir()) == ["b.txt", "manifest.json"]  # never a mix of two runs


def test_overwrite_never_replaces_what_is_not_a_run(tmp_path):
    """A home folder, a project folder, a checkpoint: --overwrite only replaces a folder a run published."""
    final = tmp_path / "project"
    final.mkdir()
    (final / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="not an exporter run"):
        OutputFolder(final, overwrite=True).open()
    assert (final / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("where, words", [("ckpt", "is the checkpoint"), (".", "holds the checkpoint"),
                                          ("ckpt/exported", "lies inside the checkpoint folder")])
def test_an_output_folder_keeps_clear_of_a_checkpoint_folder(tmp_path, where, words):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(OutputError, match=words):
        OutputFolder(tmp_path / where, overwrite=True, keep_clear=checkpoint).open()
    assert (checkpoint / "model.safetensors").read_bytes() == b"weights"


def test_an_output_folder_beside_a_checkpoint_file_is_fine_one_holding_it_is_not(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    with OutputFolder(tmp_path / "out", keep_clear=weights) as folder:
        assert folder.staged.is_dir()
    with pytest.raises(OutputError, match="holds the checkpoint"):
        OutputFolder(tmp_path, overwrite=True, keep_clear=weights).open()


def test_a_failed_run_leaves_nothing(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with OutputFolder(final) as folder:
            write_atomic(folder.staging / "half.txt", "x")
            raise RuntimeError("stage failed")
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no lock file left either


def test_a_published_run_leaves_only_its_folder(tmp_path):
    with OutputFolder(tmp_path / "out") as folder:
        write_atomic(folder.staging / "a.txt", "x")
        folder.publish()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_run_that_opened_the_lock_as_its_holder_removed_it_takes_the_new_one(tmp_path):
    """The holder removes the lock file on release; a run that opened the old file meanwhile must not hold a lock
    no later run can see."""
    import fcntl
    import os

    first = OutputFolder(tmp_path / "out")
    first.open()
    stale = os.open(first.lock_path, os.O_RDWR)  # opened before the holder lets go
    first.discard()
    first.release()
    assert not first.lock_path.exists()
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the removed file: lockable, but no longer the lock
    second = OutputFolder(tmp_path / "out")
    second.open()  # takes the file now at the lock's path
    try:
        with pytest.raises(OutputError, match="another exporter run is writing"):
            OutputFolder(tmp_path / "out").open()
    finally:
        os.close(stale)
        second.discard()
        second.release()


def test_an_unwritable_junit_path_is_refused_before_any_work():
    """Permissions do not bind root: /sys refuses everyone a new file, and the refusal must come up front."""
    from exporter.junit import check_writable

    with pytest.raises(OutputError, match="cannot write the JUnit file"):
        check_writable("/sys/exporter-junit.xml")
    with pytest.raises(OutputError):
        write_atomic(__import__("pathlib").Path("/sys/exporter-junit.xml"), "x")


def test_second_run_into_the_same_folder_fails_fast(tmp_path):
    first = OutputFolder(tmp_path / "out")
    first.open()
    try:
        with pytest.raises(OutputError, match="another exporter run is writing"):
            OutputFolder(tmp_path / "out").open()
    finally:
        first.discard()
        first.release()
    second = OutputFolder(tmp_path / "out")
    second.open()
    second.discard()
    second.release()


def test_not_writable(tmp_path):
    """A folder the user may not write (as root, where permissions do not bind: /sys, which refuses everyone)."""
    import os

    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        parent = locked if not os.access(locked, os.W_OK) else __import__("pathlib").Path("/sys/exporter-test")
        with pytest.raises(OutputError, match="(not writable|cannot write).*writable --out"):
            OutputFolder(parent / "out").open()
    finally:
        locked.chmod(0o700)


def test_published_paths_name_no_folder_outside_and_no_user(tmp_path, monkeypatch):
    import getpass

    from exporter.outdir import path_from, public_command, public_path

    out, checkpoint = tmp_path / "runs" / "out", tmp_path / "models" / "bert"
    checkpoint.mkdir(parents=True)
    assert path_from(out, checkpoint) == "../../models/bert"  # moves with the folder
    assert path_from(tmp_path / "out", "/usr/share") == "share"  # nothing in common but the root
    monkeypatch.setattr(getpass, "getuser", lambda: "models")  # a path through "the user's" folder
    assert path_from(out, checkpoint) == "bert"
    monkeypatch.chdir(tmp_path)
    assert public_path(checkpoint) == "models/bert" and public_path("/usr/share") == "share"
    assert public_command(["exporter", "convert", str(checkpoint), "--out=/srv/x"]) == \
        ["exporter", "convert", "models/bert", "--out=x"]
