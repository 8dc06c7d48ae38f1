"""Worker functions that `minidist.runtime.launch` imports in each spawned rank (see tests/runtime/workers.py)."""

from minidist import finetune


def train_each(argvs):
    """Run the training loop once per argument list, one after the other, in the same ranks."""
    for argv in argvs:
        finetune.train(finetune.parse_args(argv))
