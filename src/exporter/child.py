"""``python -m exporter.child FD``: the process that loads and runs one variant (see runners.RemoteRunner)."""

import sys

from exporter.runners import child_main

if __name__ == "__main__":
    child_main(int(sys.argv[1]))
