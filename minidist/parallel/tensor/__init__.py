"""Tensor parallelism (lesson 11): every weight matrix of a layer cut over the ranks of a group,
which all see the same tokens (Shoeybi et al. 2019, "Megatron-LM"), and sequence parallelism,
which cuts what lies between the blocks along the sequence (Korthikanti et al. 2022).

Read in this order: `ops.py` (what crosses the ranks, forward and backward), `linear.py` (the two
ways to cut a matrix), `vocab.py` (the embedding, the head and the loss), `llama.py` (a Hugging
Face Llama cut in place). Then `traffic.py` (the bytes per step by formula, beside FSDP's), and
`reference.py` (PyTorch's own tensor parallelism on the same model, the reference). Where the cut
shows in a run (the loss, clipping, the whole weights, checkpoints) is the tensor axis,
`strategy/tensor.py` and `strategy/state/tensor.py`. Nothing is imported here: each module is
imported by its own name.
"""
