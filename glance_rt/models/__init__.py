"""The modules the passes run:

target.py     TargetDecoder: our forward over a Hugging Face model's text-decoder weights
drafter.py    GlanceDrafter: the block-diffusion drafter (config, weights, its one forward, checkpoints)
kv_cache.py   static KV cache written by index
attention.py  glance::tree_attention, the one named op for tree attention
linear.py     glance::packed_linear, oneDNN-prepacked linear layers
"""
