"""Pipeline parallelism (lesson 12): the model cut by depth into stages, one per rank, and the
micro-batches of a step streamed through them (Huang et al. 2019, "GPipe"; Narayanan et al. 2019,
"PipeDream", whose one-forward-one-backward order became Megatron-LM's 1F1B).

Tensor parallelism cuts every layer and talks inside each of them; pipeline parallelism keeps
every layer whole and talks only where the model is cut: one stage's output activations go to the
next stage, and their gradients come back. That is little traffic (a micro-batch's hidden states
per cut, against a whole layer's weights for FSDP), which is why the largest runs put their
pipeline across nodes. The price is the bubble: the first stage waits for nothing at the start but
the last waits for p - 1 forwards, and the first waits at the end for p - 1 backwards.

Read in this order: `stages.py` (where the model is cut, and what each stage computes),
`p2p.py` (what crosses a cut, how its shape is known, and which sends and receives are posted
together, as NCCL needs), `schedules.py` (GPipe and 1F1B as plain lists of actions), `executor.py`
(one loop that runs any such list, after checking that it cannot deadlock, on gloo's rule and on
NCCL's), then `generate.py` (greedy decoding through the stages, for the legal-move rate) and
`reference.py` (PyTorch's own `torch.distributed.pipelining` around the same stages, `--impl
torch`). What the training loop does differently under `--pp_size` is the pipeline axis,
`strategy/pipeline.py`; the bubble, measured from the executor's timeline, is `bench/bubble.py`.
Nothing is imported here: each module is imported by its own name.
"""
