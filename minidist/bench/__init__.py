"""Benchmarks: the hand-written strategies against PyTorch's own as ratios; a collective's bandwidth.

    python -m minidist.bench ddp        # naive DDP, bucketed DDP, torch DDP; 2 CPU ranks
    python -m minidist.bench fsdp       # FSDP, ZeRO-2 (minidist) and torch FSDP2; 2 CPU ranks
    python -m minidist.bench fsdp --world_size 1 --hidden_size 512 --num_layers 8 --batch_size 2 --seq_len 32
                                        # one rank, no communication, the weights dominate
    python -m minidist.bench allreduce  # all-reduce time, algbw and busbw per message size; 2 CPU ranks
    torchrun --nproc_per_node 4 -m minidist.bench allreduce   # the same on 4 GPUs (nccl)

- `strategies.py`: step time and whole-step peak memory of each implementation, turn by turn,
  as ratios to PyTorch's, with their spread over the rounds.
- `collectives.py`: one collective per message size, as NVIDIA's nccl-tests time it.
- `__main__.py`: the command.

Nothing is imported here: each module is imported by its own name (`launch` starts fresh
interpreters that import a worker function by its module's name).
"""
