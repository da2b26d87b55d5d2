"""A child forked from the warm server is what a child started cold is: ``python -m`` semantics, its own session,
output file, environment, working and temporary folders and handed descriptors, and an exit code that names the
signal that ended it; where the server cannot fork, the same child starts cold."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from exporter import forkserver

PROBE = "exporter.testing.fork_probe"


def probe(tmp_path, code: str, name: str = "a", pass_fds=(), **env_extra):
    env = {**os.environ, "FORK_PROBE": name, "TMPDIR": str(tmp_path), **env_extra}
    log = tmp_path / f"{name}.log"
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        args = [str(tmp_path / f"{name}.json"), code, *(["{0}"] if pass_fds else [])]
        process = forkserver.start(PROBE, args, env, out, tuple(pass_fds), [sys.executable, "-P"])
    finally:
        os.close(out)
    return process, tmp_path / f"{name}.json", log


def test_a_forked_child_is_what_a_cold_one_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine, theirs = socket.socketpair()
    try:
        process, answer, log = probe(tmp_path, "3", pass_fds=(theirs.fileno(),))
    finally:
        theirs.close()
    assert isinstance(process, forkserver.Forked)
    assert process.wait(60) == 3 and process.returncode == 3 and process.poll() == 3
    facts = json.loads(answer.read_text())
    assert facts["ppid"] in forkserver.server_pids()  # forked: its parent is the server, not this process
    assert facts["pid"] == process.pid and facts["sid"] == process.pid  # a session of its own
    assert facts["cwd"] == str(tmp_path) and facts["tmp"] == str(tmp_path) and facts["probe"] == "a"
    assert facts["name"] == "__main__" and facts["fd_open"]  # python -m semantics; the socket handed over
    assert str(tmp_path) not in facts["path"]  # -P: the folder it starts in is not importable
    assert log.read_text() == f"probe {process.pid} ran\n"
    mine.close()


def test_a_signal_is_named_in_the_exit_code_and_the_next_child_is_forked_again(tmp_path):
    process, answer, _ = probe(tmp_path, "sleep")
    assert process.poll() is None
    pid = process.pid
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.3)
    os.killpg(pid, signal.SIGKILL)
    assert process.wait(30) == -signal.SIGKILL
    again, answer, _ = probe(tmp_path, "0", name="b")
    assert again.wait(60) == 0 and json.loads(answer.read_text())["ppid"] in forkserver.server_pids()


def test_without_a_server_the_same_child_starts_cold(tmp_path, monkeypatch):
    monkeypatch.setenv(forkserver.ENV, "0")
    process, answer, log = probe(tmp_path, "4")
    assert isinstance(process, subprocess.Popen)
    assert process.wait(60) == 4
    facts = json.loads(answer.read_text())
    assert facts["ppid"] == os.getpid() and facts["probe"] == "a" and facts["tmp"] == str(tmp_path)
    assert log.read_text() == f"probe {process.pid} ran\n"


def test_a_request_waiting_on_a_server_that_ended_starts_cold(tmp_path):
    """The server is killed before it answered: the child waiting for it is started cold, with its files."""
    forkserver.stop()
    process, answer, log = probe(tmp_path, "5", HF_HOME=str(tmp_path / "hf"))  # a new server for this environment
    (server,) = [s for s in forkserver._servers.values() if s.ready is None]
    server.process.kill()
    server.process.wait()
    assert process.wait(60) == 5
    assert json.loads(answer.read_text())["ppid"] == os.getpid() and log.read_text().startswith("probe ")
    forkserver.stop()


def test_without_safe_path_the_folder_a_forked_command_starts_in_comes_first_on_its_path(tmp_path):
    """As ``python -m`` puts it there: a command forked for ``tmp_path`` imports from ``tmp_path``, not from the
    folder its server started in (what the checks that refuse modules planted beside a file rely on)."""
    (tmp_path / "planted_here.py").write_text("VALUE = 7\n")
    env = {**os.environ, "FORK_PROBE": "c"}
    out = os.open(tmp_path / "c.log", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        process = forkserver.start(PROBE, [str(tmp_path / "c.json"), "0"], env, out, (), [sys.executable],
                                   cwd=str(tmp_path))
    finally:
        os.close(out)
    assert isinstance(process, forkserver.Forked) and process.wait(60) == 0
    facts = json.loads((tmp_path / "c.json").read_text())
    assert facts["path"][0] == str(tmp_path) and facts["ppid"] in forkserver.server_pids()


def test_a_child_killed_as_soon_as_it_was_asked_for_ends(tmp_path):
    """kill() before its pid was read (the request sent, the server forking): the kill waits for the pid and lands."""
    warm, _, _ = probe(tmp_path, "0", name="warm")
    assert warm.wait(60) == 0  # the server is up: the next request is sent at once
    process, answer, _ = probe(tmp_path, "sleep", name="d")
    process.kill()
    assert process.wait(10) == -signal.SIGKILL
