"""Artifacts: a Program as TOSA files (.mlir, .tosa flatbuffer), and Arm's tosa-tools run on them
(tosa-opt, the TOSA reference model)."""
