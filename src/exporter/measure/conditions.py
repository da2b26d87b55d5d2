"""The process conditions a variant is timed under, alike for every variant.

Eager and the rewritten model are timed in the convert process; each artifact in a child process. What makes a
CPU timing differ between processes besides the code: OpenMP's wait policy (idle threads that spin keep cores busy
while another variant is timed; they are read once, when the OpenMP runtime loads with torch), the number of intra-
and inter-op threads, and the CPUs the process may run on. :func:`settle` gives this process the same wait policy its
children get (``OMP_WAIT_POLICY=PASSIVE``, set before torch loads, unless the environment says otherwise); a child
inherits the environment (``runners.child_env``). :func:`conditions` is what each variant reports beside its timings
(``bench.process`` in ``report.json``), and the benchmark warns where a variant's differ from eager's.
Nothing here imports torch at module level.
"""

from __future__ import annotations

import os
import sys
from typing import Any

POLICY = "OMP_WAIT_POLICY"
INHERITED = "EXPORTER_INHERITED_POLICY"  # set in a child: the policy (or its absence) is its parent's, kept as is


def settle() -> None:
    """Before torch loads: idle OpenMP threads wait passively in this process, as in every child (unless the
    environment already chose a policy). Once torch has loaded, its OpenMP runtime has read the policy: nothing
    is changed, and the children inherit the same environment, so the policy stays alike."""
    if "torch" not in sys.modules and os.environ.get(INHERITED) != "1":
        os.environ.setdefault(POLICY, "PASSIVE")


def inherit(env: dict[str, str]) -> None:
    """A child's environment: this process's wait policy, or none where this process has none (OpenMP warns of an
    empty value); the child's :func:`settle` then leaves it as it is."""
    policy = os.environ.get(POLICY)
    if policy:
        env[POLICY] = policy
    else:
        env.pop(POLICY, None)
    env[INHERITED] = "1"


def conditions() -> dict[str, Any]:
    """This process's timing conditions: OpenMP wait policy, torch's intra- and inter-op threads, usable CPUs."""
    import torch  # noqa: PLC0415

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    return {"omp_wait_policy": os.environ.get(POLICY, "") or "default", "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "cpus": cpus}


def differences(eager: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """What in ``other``'s conditions is not eager's, e.g. ``threads 8 (eager's 2)``."""
    return [f"{key} {other.get(key)} (eager's {value})" for key, value in eager.items() if other.get(key) != value]


__all__ = ["conditions", "differences", "inherit", "settle"]
