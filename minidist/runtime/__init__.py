"""Running on many processes: what torchrun, SLURM or the notebooks start. A first reading may skip
this folder.

- `distributed.py`: the process group from the environment torchrun sets (NCCL on GPUs, gloo on
  CPU ranks), the rank's device and CPU threads (offload's optimizer step on a GPU node gets its
  share of the task's cores), the wait for rank 0's read of the weights, and the clean-up.
- `launch.py`: N ranks started from a notebook or a test, as torchrun would (simulated nodes too),
  each rank's result or failure brought back.
- `allocator.py`: a CPU rank's heap keeps freed large blocks for reuse (glibc's `mallopt`), as the CUDA
  caching allocator does on a GPU, so a buffer made every step (an FSDP unit) costs few page faults or none.
- `rendezvous_store.py`: torchrun's rendezvous store in a process of its own, on the head node of a
  SLURM job, so that it outlives every node's torchrun (else: a traceback at the end of a finished job).
- `errors.py`: the one-line errors a learner meets, and exit status 2.
- `metrics.py`: metrics.jsonl, one record per step, the step's line on the screen, and MFU.
- `host_syncs.py`: how many times a step waits for the GPU (`.item()`, `if tensor:`, `.tolist()`,
  ...), counted op by op, each with the line that asked.
"""
