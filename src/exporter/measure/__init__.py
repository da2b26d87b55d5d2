"""The measure stage: timing (``bench``), memory (``memory``), which attention kernels ran (``kernels``) and
why PyTorch picked the SDPA backend it did (``backend_choice``)."""
