"""minisgl: a compact, fast LLM inference server with its own CUDA and Triton kernels."""

from minisgl.engine.sampling_params import SamplingParams
from minisgl.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
