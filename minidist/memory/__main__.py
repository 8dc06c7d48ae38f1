"""`python -m minidist.memory MODEL ...`: the estimate of one rank's peak memory, as a table.

The flags are the training loop's own (`ParallelOptions`, plus the sizes of a step), so a line
that trains can be estimated by changing `-m minidist.finetune` into `-m minidist.memory MODEL`.
"""

import json
from dataclasses import fields
from pathlib import Path

from minidist.hf import hub, lora, model_folder, models
from minidist.memory import fit, estimator, pipeline, report
from minidist.strategy.options import ParallelOptions
from minidist.runtime.errors import ArgumentParser, one_line_errors


def checked_source(name: str) -> str:
    """Where the config of `name` comes from, checked: `tiny` (finetune's offline Llama) becomes
    its folder, a hub name neither cached nor reachable fails at once (`hf/hub.py`), and the config
    must describe a model that can exist (`hidden_size: 0` cannot: `model_folder.check_config`)."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' own check of a config

    source = models.resolve(name) if name == models.TINY else name
    if name not in estimator.BUNDLED and models.is_hub_name(source):
        hub.local_files_only(source)  # raises at once when neither cached nor reachable
    elif (Path(source).expanduser() / "config.json").is_file():  # a local folder: its config.json must be JSON
        model_folder.check_config_json(Path(source).expanduser())
    try:
        config = estimator.load_config(source)
    except StrictDataclassError as err:
        raise ValueError(f"the config of {name!r} cannot be a model ({model_folder.reason(err)}): fix its config.json")
    model_folder.check_config(config, name)
    return source


def main(argv=None) -> None:
    p = ArgumentParser(prog="python -m minidist.memory", description=estimator.__doc__.split("\n")[0])
    p.add_argument("model", help="hub name, local folder with a config.json, or `tiny` (the offline tiny Llama)")
    p.add_argument("--world_size", type=int, default=1)
    p.add_argument("--batch_size_per_device", type=int, default=1)
    p.add_argument("--max_seq_length", type=int, default=512)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--target_length", type=int, default=0,
                   help="an encoder-decoder's target tokens (T5, BART); by default as many as --max_seq_length")
    p.add_argument("--no_padding", dest="padded", action="store_false",
                   help="unpadded batches, every sequence --max_seq_length long: SDPA needs no mask (by default the "
                        "loop's right-padded batches)")
    p.add_argument("--pack", dest="packed", action="store_true",
                   help="as minidist.finetune's: --batch_size_per_device rows of --max_seq_length tokens, games packed "
                        "whole, with the block-diagonal mask and each game's position ids")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="gloo (CPU ranks) copies what FSDP2 and ZeRO-1 reduce-scatter; nccl (GPUs) does not")
    p.add_argument("--gpu_memory", help="say whether it fits, and the largest batch that does: 80GB, 79.2GiB")
    p.add_argument("--must_fit", action="store_true",
                   help="with --gpu_memory: one line, and exit status 2 with what would fit where the estimate does "
                        "not (memory/fit.py; the SLURM scripts check the GPUs they got with it)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--readme_table", action="store_true",
                   help="markdown: every strategy on 1, 4, 8 GPUs, with PyTorch's MemTracker beside the estimate")
    p.add_argument("--memtracker", action="store_true",
                   help="also trace one step with PyTorch's MemTracker under fake tensors (memory/tracker.py): "
                        "seconds to minutes the first time per setup, then cached")
    ParallelOptions.add_arguments(p)  # the loop's own flags: --strategy, --impl, --mixed_precision, ...
    loop_flags = {f.name for f in fields(ParallelOptions)}  # the pipeline's, until the loop's options have them
    if "pp_size" not in loop_flags:
        p.add_argument("--pp_size", type=int, default=1, help="pipeline stages: print each stage's estimate "
                       "(memory/pipeline.py); --gradient_accumulation_steps is the micro-batches")
    if "pp_schedule" not in loop_flags:
        p.add_argument("--pp_schedule", choices=("gpipe", "1f1b"), default="1f1b", help="with --pp_size")
    p.add_argument("--lora_rank", type=int, metavar="R", help="train rank-R LoRA adapters, the model frozen (lora.py)")
    p.add_argument("--lora_target_modules", help=f"as minidist.finetune's (default {lora.DEFAULT_TARGETS})")
    p.add_argument("--lora_dropout", type=float, help="as minidist.finetune's: its masks are saved (default 0)")
    p.set_defaults(mixed_precision="bf16")  # as on the GPUs (finetune's default is fp32)
    args = p.parse_args(argv)
    options = {f.name: getattr(args, f.name) for f in fields(ParallelOptions)}  # zero1/2: always minidist
    with one_line_errors("minidist.memory", ValueError, NotImplementedError, FileNotFoundError):
        sizes = ("world_size", "batch_size_per_device", "max_seq_length", "gradient_accumulation_steps", "backend", "padded",
                 "packed", "target_length")
        lora.check(lora.LoraOptions.from_args(args))  # --lora_rank 0: one line, as in the loop
        setup = estimator.setup(**{name: getattr(args, name) for name in sizes}, **options, lora_rank=args.lora_rank or 0,
                                lora_target_modules=args.lora_target_modules, lora_dropout=args.lora_dropout or 0.0)
        gpu_memory = report.parse_bytes(args.gpu_memory) if args.gpu_memory else None
        estimator.check_setup(setup)
        if args.readme_table and gpu_memory is None:
            raise ValueError("--readme_table needs --gpu_memory, e.g. 80GB")
        shape = estimator.model_shape(checked_source(args.model))
        if args.target_length and not shape.is_encoder_decoder:
            raise ValueError(f"--target_length is for encoder-decoders (T5, BART); {args.model} is a causal LM, "
                             f"whose targets are its input: leave it out")
        # The activations are traced here (`trace.py`): an architecture that cannot be, says so in one line.
        if args.readme_table:
            print(report.readme_table(shape, setup, gpu_memory))
            return
        if args.must_fit:
            if gpu_memory is None or args.pp_size > 1:
                raise ValueError("--must_fit needs --gpu_memory (the GPU's memory, e.g. 80GB), and checks runs "
                                 "without --pp_size, whose estimate is per stage")
            print(fit.verdict(shape, setup, gpu_memory))
            return
        if args.pp_size > 1:  # one row per stage (memory/pipeline.py)
            print(pipeline.format_stages(shape, pipeline.data_parallel(setup, args.pp_size), args.pp_size,
                                         args.pp_schedule or "1f1b", args.gradient_accumulation_steps))
            return
        r = report.report(shape, setup, gpu_memory, trace=args.memtracker)
    print(json.dumps(r, indent=1) if args.json else report.format_report(r))


if __name__ == "__main__":
    main()
