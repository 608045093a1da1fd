"""Attention kernels: Triton on GPU, each with a plain torch reference that the CPU worker also runs."""
