"""The measure stage: timing (``bench``), memory (``memory``), which attention kernels ran (``kernels``), how many
kernels a call launches on a GPU (``launches``) and why PyTorch picked the SDPA backend it did (``backend_choice``)."""
