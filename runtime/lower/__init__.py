"""Lower: the MLIR pass pipeline from TOSA to the LLVM dialect, with the optimizing schedule
(tiling, vectorization, packing), partitioning of long functions and the int8 kernels."""
