"""The GEMM subsystem of the linear layers, for every weight format (16-bit, FP8, INT4, MXFP4):

- dispatch.py: `linear`, the one entry the layers call (format, shape and M pick the kernel);
- table.py: the measured dispatch table (one for every format) and its on-disk cache;
- tuning.py: the one tuner that fills it at engine start, parameterised by format;
- skinny.py: the low-batch kernel template's wrappers (csrc/skinny_gemm.cuh; the weight loader a
  format policy); fp8.py: FP8 quantization helpers and the FP8 large-batch GEMM;
- reference.py: every format's fp32 dequantize-then-matmul reference (the CPU path).
"""

from minisgl.ops.gemm.dispatch import FORMATS, INT4, MXFP4, linear
from minisgl.ops.gemm.reference import skinny_gemm_reference
from minisgl.ops.gemm.skinny import DENSE, FP8_FORMAT, skinny_gemm, skinny_gemm_fp8

__all__ = ["DENSE", "FORMATS", "FP8_FORMAT", "INT4", "MXFP4", "linear", "skinny_gemm",
           "skinny_gemm_fp8", "skinny_gemm_reference"]
