"""Triton kernels registered as ``torch.library.triton_op``: ``torch.export`` keeps each as one node and
AOTInductor compiles it into the package, so a package that holds one needs nothing of ours to load.

- :mod:`.decode_attention`: the attention of one decode step over a static KV cache, the mask read as one row
  and grouped-query heads read once (the decode program of batch 1).
"""
