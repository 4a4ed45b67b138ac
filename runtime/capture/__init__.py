"""Capture: a PyTorch callable or ExportedProgram as a core-ATen FX graph (TorchDynamo +
AOTAutograd with a decomposition table valid for training, or torch.export) with each repeated
layer traced once, its symbolic sizes, and frozen weights; the torch.compile backend's inference,
forward and backward graphs."""
