"""GPU kernels (Triton), each beside the torch reference that CI runs on the CPU."""
