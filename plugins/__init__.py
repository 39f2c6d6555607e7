"""GPU kernels and engine plugins for tree attention (imported only by the code paths that run them)."""
