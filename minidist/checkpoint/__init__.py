"""Operations: nothing lost when a run stops (lesson 08). A first reading may skip this folder.

- `session.py`: the one object the training loop holds for all of it: the output folder claimed,
  the stop signals caught, a checkpoint after the steps that need one, the final model at the end.
- `state.py`: a checkpoint, saved by every rank and resumed exactly (weights, Adam moments,
  learning-rate step, RNGs, data position, metrics), full or sharded; what a resume must share
  with the run that saved it.
- `checksums.py`: every file of a checkpoint checked before it is trusted.
- `data_only.py`: a sharded checkpoint read as data, never code (DCP's pickles, restricted).
- `save_errors.py`: a save that cannot be written (a full disk, a read-only folder) said in one
  line by every rank, and a state that is not finite never saved.
- `output_dir.py`: the output folder's lock, another run's checkpoints refused, the names minidist writes.
- `preemption.py`: SIGTERM, SIGUSR1 and Ctrl-C turned into "save after this step, then stop",
  agreed by every rank; exit status 75 for the batch script to requeue.
- `final_model.py`: the fine-tuned model written as a `from_pretrained` folder (LoRA: the adapter).

The flat shards of the hand-written ZeRO and FSDP join a checkpoint through
`parallel/flat_state.py`, beside the flat layout they come from.
"""
