"""Memory: where the bytes of a training step go, estimated before a run and measured during it.

- `estimator.py`: the estimate for any model, strategy and batch, from the config alone
  (the model is built on the meta device: no weights are read).
- `moments.py`: the moments of a step where one rank's memory peaks, walked per strategy;
  `hybrid.py`: HSDP's terms; `lora_terms.py`: LoRA's; `offload_split.py`: `--cpu_offload`'s
  device and host columns; `tensor_parallel.py`: tensor and sequence parallelism's (a rank's slice).
- `trace.py`: what a model saves for backward, traced on fake tensors, per layer (`llama_layer.py`:
  the same for a Llama layer, derived by hand); `cache.py` keeps traces on disk.
- `measure.py`: what the training loop records each step, term by term, on every rank, and the
  whole step's peak of live tensors (`LiveTensors`); `sides.py`: that peak split into device and
  host under `--cpu_offload`.
- `timeline.py`: live bytes over one step, sampled (`MemoryTimeline`), and their figure.
- `report.py`: the estimate as people read it: a table, a README table, other estimators' figures.
- `tracker.py`: PyTorch's own `MemTracker` on one step of the whole model under fake tensors.
- `evaluation.py`: what `Seq2SeqTrainer`'s evaluation adds (`generate`'s KV cache, the eval forward, kept
  predictions) and reserved against allocated memory: lesson 00's T5 diary.
- `__main__.py`: the command, `python -m minidist.memory MODEL --strategy fsdp --world_size 4 ...`.

Nothing is imported here: `import minidist.memory.measure` (the loop's) does not load the estimator.
"""
