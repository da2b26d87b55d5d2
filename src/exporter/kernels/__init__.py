"""Triton kernels registered as ``torch.library.triton_op``: ``torch.export`` keeps each as one node and
AOTInductor compiles it into the package, so a package that holds one needs nothing of ours to load.

- :mod:`.decode_attention`: the attention of one decode step over a static KV cache, the mask read as one row
  and grouped-query heads read once (the decode program of batch 1).
- :mod:`.gemv`: a product of one row with the RMSNorm before it, the gated activation after a fused gate/up
  product and the residual add after it folded in, the weight in the activation's dtype or in fp8 with its row
  scales; :mod:`.decode_products` is the rewrite of the decode program of batch 1 that puts it in place of the
  patterns it matches, ``exporter::fp8_gemv`` among them (``generation.decode_gemv_kernel``).
- :mod:`.decode_step_attention`: that attention with the step's rotary embedding of q and the key and its cache
  write folded in, and the rewrite of the decode program of batch 1 that puts it in place of the three
  (``generation.decode_step_kernel``).
"""
