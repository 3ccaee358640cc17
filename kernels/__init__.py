"""Triton kernels, installed as minisgl.kernels."""
