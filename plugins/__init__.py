"""GPU kernels and engine plugins for tree attention (imported only by the code paths that run them)."""

TENSORRT_PLUGIN = "glance::TreeAttention"  # namespace::name, as plugins/tensorrt_plugin.py registers it
