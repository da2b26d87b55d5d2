"""The report stage: ``report.json`` (:mod:`.assemble`, validated by ``schema.json``), ``report.md``
(:mod:`.markdown`), a latency chart (:mod:`.chart`), and ``manifest.json`` (:mod:`.files`); a
``--task text-generation`` run's report and its schema are :mod:`.generation`.

Every file is written atomically; ``manifest.json`` is written last, so its presence means the run
finished. It holds the SHA-256 of the checkpoint and of every file in the output folder, the resolved
recipe, the software versions and the device, so a release can be verified later.
"""

from .assemble import REPORT_SCHEMA_VERSION, SCHEMA_FILE, assemble, command_schema, report_schema
from .files import write_all
from .markdown import kernel_summary, render_markdown

__all__ = ["assemble", "command_schema", "render_markdown", "write_all", "kernel_summary", "report_schema",
           "SCHEMA_FILE",
           "REPORT_SCHEMA_VERSION"]
