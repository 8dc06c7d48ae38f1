"""`python -m minidist.memory ... --gpu_memory M --must_fit` (`minidist/memory/fit.py`): the check the
SLURM scripts run against the smallest GPU of a job before anything loads.

The capstone's run (CodeLlama-7b, FSDP by hand on 4 GPUs, 4 x 512 tokens, 2 micro-batches, sharded
accumulation, packed rows) on an A100-80GB (81,920 MiB, as nvidia-smi reports it) fits; on an
A100-40GB (40,960 MiB) it does not, and the line names each change of flags that fits, with its
estimated peak. Without sharded accumulation no single change fits, and the pairs that do are named.
"""

import pytest
from in_process import said

from minidist.memory import __main__ as memory_command
from minidist.memory import fit

CAPSTONE = ["codellama/CodeLlama-7b-hf", "--impl", "minidist", "--strategy", "fsdp", "--world_size", "4",
            "--batch_size_per_device", "4", "--gradient_accumulation_steps", "2", "--max_seq_length", "512",
            "--mixed_precision", "bf16", "--pack"]


def test_the_capstone_fits_an_a100_80gb_in_one_line(capsys):
    memory_command.main([*CAPSTONE, "--accumulate_sharded", "--gpu_memory", "81920MiB", "--must_fit"])
    assert capsys.readouterr().out == ("fits: the estimated peak, 41.97 GB per GPU, and 5.00 GB for what it leaves "
                                       "out are within the 85.90 GB of the smallest GPU here\n")


def test_on_an_a100_40gb_it_is_refused_with_what_would_fit(capsys):
    line = said(memory_command.main, [*CAPSTONE, "--accumulate_sharded", "--gpu_memory", "40960MiB", "--must_fit"],
                capsys)
    assert line == ("minidist.memory: error: the estimated peak, 41.97 GB per GPU, and 5.00 GB for what it leaves out "
                    "(the CUDA context, NCCL's buffers, fragmentation) are more than the 42.95 GB of the smallest GPU "
                    "here: the run would stop, out of memory, in its first step; what fits (estimated peak): "
                    "--gradient_checkpointing (33.69 GB); --cpu_offload (18.29 GB); --batch_size_per_device 2 (36.02 GB)")


def test_where_no_single_change_fits_the_pairs_that_do_are_named(capsys):
    line = said(memory_command.main, [*CAPSTONE, "--gpu_memory", "40960MiB", "--must_fit"], capsys)
    assert "the estimated peak, 61.56 GB per GPU" in line
    assert line.endswith("what fits (estimated peak): --accumulate_sharded --gradient_checkpointing (33.69 GB); "
                         "--accumulate_sharded --cpu_offload (18.29 GB); --gradient_checkpointing --cpu_offload "
                         "(33.43 GB)"), line


def test_every_named_change_fits_and_the_run_as_given_does_not():
    """The alternatives are estimates of real setups: each is within the room, the run is not."""
    from minidist.memory import estimator

    shape = estimator.model_shape("codellama/CodeLlama-7b-hf")
    setup = estimator.setup(world_size=4, batch_size_per_device=4, gradient_accumulation_steps=2, max_seq_length=512,
                            packed=True, strategy="fsdp", impl="minidist")
    room = 40960 * 2**20 - fit.RESERVE
    assert estimator.estimate(shape, setup)["peak"] > room
    ways = fit.alternatives(shape, setup, room)
    assert ways and all(peak <= room for _, peak in ways)


@pytest.mark.parametrize("argv, expected", [
    (["tiny", "--must_fit"], "--must_fit needs --gpu_memory"),
    (["tiny", "--impl", "minidist", "--gpu_memory", "80GB", "--must_fit", "--pp_size", "2"],
     "checks runs without --pp_size"),
])
def test_must_fit_without_what_it_needs_is_one_line(capsys, argv, expected):
    assert expected in said(memory_command.main, argv, capsys)
