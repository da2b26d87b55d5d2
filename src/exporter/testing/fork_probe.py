"""``python -m exporter.testing.fork_probe ANSWER.json CODE [FD]``: what a child process sees of itself (pid,
parent, session, working folder, temporary folder, arguments, one environment variable, whether descriptor ``FD``
is its own, its import path), written to ``ANSWER.json``; then it prints a line and exits with ``CODE`` (``sleep``:
waits to be killed). The fork server's tests run it both forked and started cold."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main(argv: list[str]) -> int:
    answer, code, *rest = argv
    facts = {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "cwd": os.getcwd(),
             "tmp": tempfile.gettempdir(), "argv": argv, "probe": os.environ.get("FORK_PROBE"),
             "name": __name__, "fd_open": bool(rest) and os.path.exists(f"/proc/self/fd/{rest[0]}"),
             "path": sys.path}
    with open(answer, "w", encoding="utf-8") as handle:
        json.dump(facts, handle)
    print(f"probe {os.getpid()} ran", flush=True)
    if code == "sleep":
        time.sleep(600)
    return int(code)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
