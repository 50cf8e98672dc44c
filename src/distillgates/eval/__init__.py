"""Evaluation: scorer, tool broker, runners, sharded eval, fingerprints and the report schema.

Import from the submodules (nothing is re-exported here): importing one part of the package
never runs the others, so each pipeline step's code fingerprint covers only what it uses.
"""
