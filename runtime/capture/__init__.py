"""Capture: a PyTorch callable or ExportedProgram as an inference-only core-ATen FX graph
(TorchDynamo + AOTAutograd, or torch.export) with each repeated layer traced once, its symbolic
sizes, and frozen weights."""
