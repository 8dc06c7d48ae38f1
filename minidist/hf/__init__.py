"""The Hugging Face side: models, their files, and LoRA. A first reading may skip this folder.

- `models.py`: every model is loaded through `from_pretrained`, CodeLlama-7b and the offline tiny
  Llama alike (`python -m minidist.hf.models tiny|download`); the cache folder.
- `hub.py`: is a hub name cached, is the hub there: a compute node without internet loads from
  its cache at once, or says in one line why it cannot.
- `model_folder.py`: a model folder checked before the expensive load (config, tokenizer, weights).
- `lora.py`: LoRA through peft (`LoraOptions`, `--lora_rank`): the base frozen, the same adapters
  on every rank.
- `configs/`: the configs of the models whose shapes the memory estimator knows without a
  download (CodeLlama-7b, t5-base).
"""
