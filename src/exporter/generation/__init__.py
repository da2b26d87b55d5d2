"""Decoders that generate: ``exporter convert --task text-generation`` and ``exporter generate``.

The task is this package's; the machinery is the stages' (each target writes and loads its own decoder
programs, the timing loop is ``measure/bench``, the report ``report/generation``, the child process
``runners.run_session``):

- ``cache``: ``DecoderStep``, one forward over a static KV cache the caller owns (the decoder contract);
- ``programs``: the prefill and decode programs exported from it;
- ``driver``: greedy generation (free or teacher-forced) from any pair of steps, and a target's steps loaded;
- ``reference``: the original model generating without a cache, float64, and the eager baseline;
- ``judge``: per-step verdicts and where tokens differ; ``bench``: what a decode's timing is held to;
- ``session``: one target judged and timed in its own process; ``run``: the convert, stage by stage;
- ``generate``: ``exporter generate`` from a built folder.
"""
