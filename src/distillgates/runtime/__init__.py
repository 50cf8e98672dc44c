"""Generation runtime: one engine protocol, a PyTorch (fused decoder) and a Core ML engine, prompt cache,
speculative decoding, constrained JSON decoding and the batch policy.

Import from the submodules (nothing is re-exported here): importing one part of the package
never runs the others, so each pipeline step's code fingerprint covers only what it uses.
"""
