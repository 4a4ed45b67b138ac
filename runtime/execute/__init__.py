"""Execute: the lowered module JIT-compiled and called on torch tensors, or linked into a shared
library with a C header; updates of the caller's tensors written back in place."""
