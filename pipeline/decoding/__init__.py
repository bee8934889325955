"""Speculative decoding as a library, under the stages: the EAGLE-2 draft tree (tree.py), lossless verification
(verify.py: greedy and rejection sampling), the drafters (drafter.py: a trained head, EAGLE or Medusa; lookup.py:
prompt lookup), the decoder that runs a target with a drafter (decoder.py) and the measured tree choice
(autotree.py). The eval stage, train's tau probe and the benches decode with it."""
