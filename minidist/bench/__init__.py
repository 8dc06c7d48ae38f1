"""Benchmarks: the hand-written strategies against PyTorch's own, as ratios; a collective's
bandwidth; a pipeline's bubble; what sequence packing buys; the GPU check.

    python -m minidist.bench ddp        # naive DDP, bucketed DDP, torch DDP: hidden sizes 256 to 2048 on 1 and 2
                                        # CPU ranks, each goal's ratio with its spread, page faults per step
    python -m minidist.bench fsdp       # FSDP, ZeRO-2 (minidist) and torch FSDP2: the same sweep
    python -m minidist.bench fsdp --world_size 1 --hidden_size 512 --num_layers 8
                                        # one size on one rank, every implementation's row in full
    python -m minidist.bench allocator  # FSDP and FSDP2 per hidden size, glibc's defaults against freed blocks kept
    python -m minidist.bench allreduce  # all-reduce time, algbw and busbw per message size; 2 CPU ranks
    torchrun --nproc_per_node 4 -m minidist.bench allreduce   # the same on 4 GPUs (nccl)
    python -m minidist.bench bubble     # a pipeline's idle time per stage against (p - 1) / (m + p - 1): CPU ranks
    python -m minidist.bench packing    # the training loop with and without --pack on 2 CPU ranks: real tokens/s,
                                        # padding, the ratio against its bound; the padding of any tokenizer at
                                        # the capstone's layout (--tokenizer tiny codellama/CodeLlama-7b-hf)
    python -m minidist.bench gpu        # the GPU check: every strategy on one GPU, in minutes
    python -m minidist.bench gpu --smoke  # the same code on the CPU, tiny sizes, in seconds

- `strategies.py`: step time, whole-step peak memory and minor page faults of each implementation,
  turn by turn, as ratios to PyTorch's, with their spread over the rounds.
- `sweep.py`: the same over hidden sizes and world sizes, as one table of goals met or missed.
- `allocator.py`: the hand-written FSDP and FSDP2 per hidden size, each size in a fresh one-rank child with
  glibc's defaults and with freed blocks kept: step time, page faults, system and user time (lesson 05).
- `collectives.py`: one collective per message size, as NVIDIA's nccl-tests time it; and, in a world
  of one, what a collective through NCCL itself costs beside the local copy `comm.py` makes.
- `gpu.py`: the GPU check. At world size 1 over NCCL, all six setups (PyTorch's DDP and FSDP2,
  the hand-written DDP, ZeRO-1, ZeRO-2, FSDP) in bf16 with gradient accumulation 2, with and
  without activation checkpointing, on a Llama of about 1B at 16,384 tokens a step: step time,
  tokens/s, MFU, allocated and reserved peak memory against the estimate, and the step time
  against PyTorch's; CodeLlama-7b's shapes with FSDP; each row only where its estimate fits the
  GPU. It writes `table.md`, a profiler trace of one FSDP step and its memory snapshot.
- `bubble.py`: a pipeline's bubble measured: each stage's idle share of a step, on the host's clock and
  replayed on a core per stage, against (p - 1) / (m + p - 1) (lesson 12).
- `packing.py`: `python -m minidist.finetune` itself with and without `--pack`, turn by turn: real tokens
  per second from its `metrics.jsonl`, the padding's share, their ratio with its spread over the rounds,
  and the bound, padded positions over packed ones; and, without training, the padding of a tokenizer's
  games at a layout, counted by the loop's own `step.step_token_counts`.
- `gpu_report.py`: the GPU check's table and its goals.
- `gate.py`: which rows run on this GPU: those whose estimate, with a reserve, fits.
- `offload.py`: the GPU check's rows with and without `--cpu_offload`; `threads.py`: the CPU
  threads they are timed on, those of a torchrun rank.
- `snapshot.py`: the allocator's reserved peak, and one step's memory snapshot for pytorch.org/memory_viz.
- `timeline.py`: one step under `torch.profiler`: its Chrome trace, and its timeline as a PNG.
- `__main__.py`: the command.

Nothing is imported here: each module is imported by its own name (`launch` starts fresh
interpreters that import a worker function by its module's name).
"""
