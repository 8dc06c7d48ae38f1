"""The mechanisms: what the lessons teach, one idea per module, in lesson order.

    01  comm.py          collectives, the bytes each rank sends under the ring algorithm, a ring
                         all-reduce by hand, and where a collective on a host tensor runs
    02  ddp.py           data parallelism: naive, then bucketed with communication overlapping backward
        wrapper.py       what the hand-written wrappers share: broadcast, no_sync, weak hooks; buckets
                         and the gradient count (DDP and ZeRO)
    03  (no_sync)        gradient accumulation: `wrapper.py`'s `no_sync`, driven by `step.train_step`
    04  zero.py          ZeRO-1 (also as an optimizer around any torch.optim class) and ZeRO-2
        flat.py          the flat layout ZeRO and FSDP share: flatten, pad, shard; gather and scatter
                         whole flats; clipping a sharded gradient
    05  fsdp.py          ZeRO-3: units by layer class, prefetch, the story of a step, the queue of
                         reductions in flight
        unit.py          one unit's life: gather and free its weights, reduce-scatter its gradient
        streams.py       where a unit's collectives run on a GPU: their own streams, and the events
                         that order them against the computation
    06  recompute.py     activation checkpointing, one decoder layer at a time
    07  precision.py     bf16 compute, fp32 masters and reductions
    08  flat_state.py    checkpoints of flat shards (the hand-written ZeRO's and FSDP's side of
                         `checkpoint/state.py`): full or sharded, resharded on load
    09  mesh.py          the process-group layout: the data-parallel shard and replicate dimensions,
                         and the tensor and pipeline dimensions beside them
    10  offload.py       CPU offload (ZeRO-Offload): masters, moments and the optimizer step on the host
        frozen.py        frozen parameters in an FSDP unit (LoRA's base weights): gathered, never reduced
        across_nodes.py  which of a step's bytes cross from one node to another (a model of the
                         ring), and how many each NIC carries, by formula
    11  tensor/          tensor and sequence parallelism: a layer's matrices cut over the ranks
        tensor/ops.py    the conjugate operators (f, g, and sequence parallelism's gather and
                         reduce-scatter), each an autograd function
        tensor/linear.py column- and row-parallel linears
        tensor/vocab.py  the vocabulary cut: embedding, head, and a loss that never gathers logits
        tensor/llama.py  a Hugging Face Llama cut in place: heads (grouped-query attention too), MLP,
                         vocabulary, and sequence parallelism's norms
        tensor/traffic.py     tensor parallelism's bytes per step by formula, beside FSDP's
        tensor/reference.py   PyTorch's own tensor parallelism on the same Llama, the reference
    12  pipeline/        pipeline parallelism: the model cut by depth into stages, micro-batches
                         streamed through them
        pipeline/stages.py     the cut (the balance rule), and what each stage computes for itself
        pipeline/p2p.py        activations forward and their gradients back, a send posted with the next receive
        pipeline/schedules.py  GPipe and 1F1B as plain lists of actions per rank
        pipeline/executor.py   one executor for any list, which refuses one that would deadlock
        pipeline/generate.py   greedy decoding through the stages (the legal-move rate)
        pipeline/reference.py  PyTorch's own `torch.distributed.pipelining` on the same stages

How a run combines these (one data-parallel strategy, then each axis applied in order; the loss,
clipping and checkpoints where an axis shows) is `minidist/strategy/`, not here: nothing in this
folder imports it, nor the runtime, the model hub or the loop (`tests/test_layout.py`).

Lesson 00 (memory) is `minidist/memory/`. Nothing is imported here: each module is imported by its
own name.
"""
