"""What the lessons teach, one idea per module, in lesson order:

    01  comm.py          collectives, the bytes each rank sends under the ring algorithm, a ring
                         all-reduce by hand
    02  ddp.py           data parallelism: naive, then bucketed with communication overlapping backward
        wrapper.py       what the hand-written wrappers share: broadcast, no_sync, weak hooks; buckets
                         and the gradient count (DDP and ZeRO)
    03  (no_sync)        gradient accumulation: `wrapper.py`'s `no_sync`, driven by `step.train_step`
    04  zero.py          ZeRO-1 (also as an optimizer around any torch.optim class) and ZeRO-2
        flat.py          the flat layout ZeRO and FSDP share: flatten, pad, shard; gather and scatter
                         whole flats
    05  fsdp.py          ZeRO-3: units by layer class, prefetch, the story of a step, the queue of
                         reductions in flight
        unit.py          one unit's life: gather and free its weights, reduce-scatter its gradient
    06  recompute.py     activation checkpointing, one decoder layer at a time
    07  precision.py     bf16 compute, fp32 masters and reductions
    08  flat_state.py    checkpoints of flat shards (the hand-written ZeRO's and FSDP's side of
                         `checkpoint/state.py`): full or sharded, resharded on load
    09  strategy.py      the interface the training loop calls, a table of strategies, PyTorch's own
                         as the reference
        options.py       every parallel option of a run, in one dataclass
        mesh.py          the process-group layout: the data-parallel shard and replicate dimensions
    10  offload.py       CPU offload (ZeRO-Offload): masters, moments and the optimizer step on the host
        frozen.py        frozen parameters in an FSDP unit (LoRA's base weights): gathered, never reduced
    11  tensor/          tensor and sequence parallelism: a layer's matrices cut over the ranks
        tensor/ops.py    the conjugate operators (f, g, and sequence parallelism's gather and
                         reduce-scatter), each an autograd function
        tensor/linear.py column- and row-parallel linears
        tensor/vocab.py  the vocabulary cut: embedding, head, and a loss that never gathers logits
        tensor/llama.py  a Hugging Face Llama cut in place: heads (grouped-query attention too), MLP,
                         vocabulary, and sequence parallelism's norms
        tensor/whole.py  the slices joined (the final model) and the gradient's norm over them
        tensor/checkpoint.py  checkpoints of a cut model: sharded, or full at any tp size
        tensor/reference.py   PyTorch's own tensor parallelism on the same Llama, the reference
    12  pipeline/        pipeline parallelism: the model cut by depth into stages, micro-batches
                         streamed through them
        pipeline/stages.py     the cut (the balance rule), and what each stage computes for itself
        pipeline/p2p.py        activations forward and their gradients back, a send posted with the next receive
        pipeline/schedules.py  GPipe and 1F1B as plain lists of actions per rank
        pipeline/executor.py   one executor for any list, which refuses one that would deadlock

Measurement, not taught: `across_nodes.py` splits `comm.py`'s byte count into the bytes within a
node and across nodes, and the tensor-parallel group's, for metrics.jsonl (a subscriber of
`comm.counter`); `tensor/traffic.py` gives tensor parallelism's bytes by formula.

Lesson 00 (memory) is `minidist/memory/`. Nothing is imported here: each module is imported by its
own name.
"""
