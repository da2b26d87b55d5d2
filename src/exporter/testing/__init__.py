"""Models and catalogues the tests, the scripts and the benchmarks share (as ``torch.testing`` is to torch's).

- ``attention_zoo``: attention written the ways people write it, each case with what the rewrite must do;
- ``error_cases``: the error catalogue, every user mistake with the one line and exit code it must give;
- ``generation_models``: a hand-written decoder that follows the ``--task text-generation`` contract;
- ``handwritten_gpt``: a GPT whose attention is written out by hand (``--model
  exporter.testing.handwritten_gpt:build``; ``python -m exporter.testing.handwritten_gpt OUT_DIR`` saves one).

Nothing here is used by a convert; it ships with the package so that every checkout and install can run the
same cases without putting test folders on ``sys.path``.
"""
