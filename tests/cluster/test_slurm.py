"""The SLURM scripts under a real SLURM: slurmctld, two slurmd and munge on this machine.

`tests/cluster/slurm_cluster.py` starts the cluster; CPU ranks on gloo stand in for the GPUs that gres
hands out. Every script in slurm/ runs through it with the tiny model, 2 steps and short
sequences. Each test waits for its own job, and the cluster runs them side by side (each node has
this machine's cores, one per job). They are all queued at the very start of the session:
`test_the_jobs_are_queued_first` runs before any other test (`tests/cluster/conftest.py` orders it
so, and the rest of this module last), and the jobs run while the rest of the suite does:
- first the jobs whose tests send a signal or wait for SLURM's clock (a time limit, a warning, a
  requeue), at their fair share of the cores, so that a busy machine does not move what these tests
  hold; the other tests run slower meanwhile, for two or three minutes;
- then, once those have finished (`--dependency=afterany`), the others (every lesson script, and
  the jobs that stop in one line), held back (`Cluster.hold_back`: a cgroup whose CPU time is only
  what nothing else wants): they run on what the other tests leave of the cores. On CI's 2 cores
  the rest of the suite keeps them busy about three quarters of the time (a serial run, measured
  with /proc/stat), room for these jobs' ~650 CPU seconds.
When the module's tests come, at the end, they find their jobs finished, or nearly.

What only a real SLURM shows, and these tests hold the scripts to:
- sbatch runs a copy of the script from slurmd's spool folder: the jobs are submitted from a
  folder outside the repository, with no PYTHONPATH, so the scripts must find it themselves;
- srun no longer inherits --cpus-per-task (SLURM >= 22.05), visible in the cores it binds;
- the warning signal comes from the controller's clock, and srun passes it to every process;
- `scontrol requeue` ends the job at once and starts it again with the same id;
- a cluster's `python` is not the one the job needs until the site's set-up (module load, conda
  activate) has run: every job here is submitted without the venv on its PATH, and a site file
  (SITE_SETUP) puts it back, as `conda activate` would;
- a GPU constraint (`SBATCH_CONSTRAINT`, `--constraint`) picks the nodes that have the feature.

Checks that need no cluster (bad variables, no SLURM at all) run the scripts with bash directly.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minidist.chess.games import bundled_games

# The full suite only: the batch scripts under a real SLURM started on this machine.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "slurm"
SMALL = ["--max_seq_length", "48", "--eval_prefixes", "0"]  # short games, no evaluation
FINETUNE_ARGS = ["--max_steps", "2", *SMALL, "--no_save"]
# One CPU and two "GPUs" (CPU ranks) per job, instead of the scripts' 32 CPUs, 4 GPUs and the
# whole node's memory, so that four jobs run at once on two nodes.
SMALL_JOB = ["--cpus-per-task=1", "--gpus-per-node=2", "--mem=2G"]
# The rendezvous store's own process (slurm/allocation.sh's rendezvous_store), on the head node, up
# before the torchruns join it: none of them hosts it, so none takes it along (pytorch/pytorch#69520).
STORE_UP = "rendezvous store: listening on "

# Per lesson script: the lines its log must show and, where it is not a two-step fine-tune, the
# arguments and environment it takes and whether it trains (then metrics.jsonl holds steps 1, 2).
LESSONS = {
    "00_memory": {"log": ["lesson 00: the memory estimate for this run", "peak per rank", "fits in 80.00 GB: yes",
                          "torch/ddp on 2 x cpu", "step    2/2"]},
    # Not a fine-tune: the all-reduce benchmark over three small message sizes (1, 8 and 64 KiB).
    "01_collectives": {"args": ["--min_bytes", "1K", "--max_bytes", "64K", "--factor", "8", "--warmup", "1", "--iters", "2"],
                       "env": {"OPS": "all_reduce"}, "trains": False,
                       "log": ["lesson 01: collective bandwidth on 1 node(s) x 2 GPUs", "all_reduce on 2 x cpu (gloo)",
                               "peak busbw", STORE_UP]},
    "02_ddp": {"log": ["lesson 02: minidist/ddp (bucketed)", "minidist/ddp on 2 x cpu", "step    2/2"]},
    "03_accumulation": {"log": ["lesson 03: total batch 8, 2 per device, the rest accumulated",
                                "minidist/fsdp on 2 x cpu | global batch 8 = 2 x 2 ranks x 2 accumulation", "step    2/2"]},
    "04_zero": {"log": ["lesson 04: minidist/zero2", "minidist/zero2 on 2 x cpu", "step    2/2"]},
    "05_fsdp": {"log": ["lesson 05 (FSDP by hand)", "minidist/fsdp on 2 x cpu", "step    2/2"]},
    "06_activation_checkpointing": {"log": ["lesson 06: minidist/fsdp with activation checkpointing",
                                            "minidist/fsdp on 2 x cpu", "step    2/2"]},
    "07_mixed_precision": {"log": ["lesson 07: minidist/fsdp, compute bf16, gradients reduced in fp32",
                                   "minidist/fsdp on 2 x cpu", "step    2/2"]},
    "08_checkpoints": {"args": FINETUNE_ARGS + ["--save_steps", "1"], "latest": "checkpoint-2",
                       "log": ["lesson 08: sharded checkpoints", "minidist/fsdp on 2 x cpu", "step    2/2"]},
    "09_capstone": {"log": ["lesson 09 (capstone): minidist/fsdp", "minidist/fsdp on 2 x cpu", "step    2/2"]},
    # Two nodes (its own #SBATCH --nodes=2) x 2 ranks, three runs in OUTPUT_DIR/fsdp, hsdp and hsdp-lora.
    "10_multinode": {"trains": False, "log": ["lesson 10 (more than one node): flat FSDP, then HSDP, then HSDP with LoRA,"
                                              " on 2 node(s)", "minidist/fsdp on 4 x cpu", "minidist/hsdp on 4 x cpu",
                                              "LoRA r=16: training", "fsdp step 2: rank 0 sent",
                                              "hsdp step 2: rank 0 sent", "hsdp-lora step 2: rank 0 sent", STORE_UP]},
    # One node of 4 CPU ranks (GPUS_PER_NODE: the job's 2 "GPUs" cannot hold tp 2 x FSDP 2), two runs in
    # OUTPUT_DIR/tp4 and OUTPUT_DIR/tp2-fsdp2.
    "11_tensor_parallel": {"trains": False, "env": {"GPUS_PER_NODE": "4"},
                           "log": ["lesson 11 (splitting a layer): tp 4, then tp 2 x FSDP 2, on one node",
                                   "minidist/ddp x tensor-parallel 4 on 4 x cpu", "minidist/fsdp x tensor-parallel 2 on 4 x cpu",
                                   "tp4 step 2: rank 0 sent", "tp2-fsdp2 step 2: rank 0 sent",
                                   # chess_finetune.sh splits the batch over the data-parallel ranks only
                                   "accumulation over 1 data-parallel rank(s) (4 GPUs / --tp_size 4)",
                                   "accumulation over 2 data-parallel rank(s) (4 GPUs / --tp_size 2)"]},
    # The job's 2 "GPUs" as 2 pipeline stages (FSDP2 over 1 rank each), PyTorch's schedule.
    "12_pipeline_parallel": {"log": ["lesson 12 (splitting the model by depth): pp 2 x FSDP2 1 on 1 node(s)",
                                     "torch/fsdp x pipeline 2 (1f1b) on 2 x cpu", "pp2 step 2: loss",
                                     # chess_finetune.sh splits the batch over the data-parallel ranks only
                                     "accumulation over 1 data-parallel rank(s) (2 GPUs / --pp_size 2)"]},
}
LESSON_SCRIPTS = sorted(SLURM.glob("[0-9][0-9]_*.sh"))
VENV_BIN = Path(sys.executable).parent
# What a site's `conda activate` does: put the environment's python and torchrun first on PATH.
# It also reads PS1, unset in a batch shell, as conda's own scripts do: under the scripts' `set -u`
# that would end the job, so the hook must be sourced with it off.
SITE_FILE = f"""prompt_before=$PS1
export PATH={VENV_BIN}:$PATH
echo "test site: sourced on ${{SLURMD_NODENAME:-?}} at niceness $(nice)"
"""
SITE_SOURCED = "test site: sourced on "
# The background jobs' niceness, which holds them back where the cluster has no cgroup to do it
# with (and the kernel does not group processes by session: slurm_cluster.py's docstring).
BACKGROUND_NICENESS = 19
# The jobs queued first, at their fair share (module docstring): their tests signal them or wait for SLURM's clock.
TIMED = ("time-limit", "one-node", "early-warning", "preempted")
# The one line per node each start writes: GPUs (none here), then the torch the ranks import.
NODE_LINE = (rf"^node (\S+): (.*) \| torch {re.escape(torch.__version__)}, CUDA {torch.version.cuda or 'none'}, "
             r"NCCL (\S+)(?: \| (.*))?$")


def node_lines(log: str) -> dict[str, tuple[str, str]]:
    """Node name -> (its GPUs, the network variables its ranks saw), from each `node ...` line."""
    lines = re.findall(NODE_LINE, log, flags=re.M)
    assert len({name for name, *_ in lines}) == len(lines), log  # one line per node
    if shutil.which("nvidia-smi") is None:
        assert all(gpus == "no nvidia-smi" for _, gpus, _, _ in lines), log
    return {name: (gpus, network) for name, gpus, _, network in lines}



def starts(log: str) -> list[str]:
    """The log of each start of a job (`--open-mode=append`: every start writes to one file)."""
    return re.split(r"(?=^job \d+ \(start \d+\))", log, flags=re.M)[1:]

class Jobs:
    """The jobs of this module, queued together: name -> job id, log and output folder."""

    def __init__(self, cluster, folder: Path, model: str):
        self.cluster, self.folder, self.model = cluster, folder, model
        self.ids, self.logs, self.outs = {}, {}, {}
        self.watcher = None  # the thread that holds the jobs back once the timed ones are done
        self.site = folder / "site" / "minidist-site.sh"
        self.site.parent.mkdir()
        self.site.write_text(SITE_FILE)

    def submit(self, name, script, *args, options=(), env=None, output_dir=None, niceness=0):
        """Queue a job; `output_dir`: its OUTPUT_DIR (by default a folder of its own here; False: not
        set, the script's default under SCRATCH)."""
        out = output_dir or self.folder / f"out-{name}"
        path = [p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p).resolve() != VENV_BIN.resolve()]
        variables = {
            # No venv on PATH (the site file puts it there) and no PYTHONPATH (the scripts must
            # find the repository); the model cache under a scratch folder of this test's.
            "PATH": os.pathsep.join(path), "SITE_SETUP": str(self.site), "SCRATCH": str(self.folder / "scratch"),
            "MODEL": self.model, "DATA": str(bundled_games("train")), "OUTPUT_DIR": str(out),
            "TOTAL_BATCH_SIZE": "8", "BATCH_SIZE_PER_DEVICE": "2", "HF_HUB_OFFLINE": "1", **(env or {}),
        }
        if output_dir is False:
            del variables["OUTPUT_DIR"]
        unwanted = ("PYTHONPATH", "HF_HOME", "VIRTUAL_ENV", "PS1")
        env_all = {k: v for k, v in os.environ.items()
                   if k not in unwanted and not k.startswith(("SBATCH_", "NCCL_", "GLOO_"))} | variables
        # Submitted by a path relative to a folder outside the repository, as a learner might.
        script = os.path.relpath(SLURM / script, self.folder)
        job = self.cluster.sbatch(script, *args, options=[f"--job-name={name}", "--output=%x-%j.out", *options],
                                  env=env_all, cwd=self.folder, niceness=niceness)
        if output_dir is False:  # the script's own default
            out = self.folder / "scratch" / "minidist" / "runs" / f"chess-{job}"
        self.ids[name], self.outs[name] = job, out
        self.logs[name] = self.folder / f"{name}-{job}.out"
        return job

    def planted_gpus(self, name: str, mib: int) -> Path:
        """A site file that also puts a planted `nvidia-smi` and `torchrun` first on PATH: two "GPUs" of
        `mib` MiB on every node, as nvidia-smi answers the scripts' two questions (describe_nodes'
        and gpu_memory_check's), and a torchrun whose --help lists neither --signals-to-handle nor
        --shutdown-timeout, as before torch 2.9 (it runs the real one for anything else). Returns the
        site file, for SITE_SETUP."""
        bin_dir = self.folder / f"{name}-bin"
        bin_dir.mkdir()
        old_torchrun = bin_dir / "torchrun"
        old_torchrun.write_text(f"""#!/bin/bash
if [[ $1 == --help ]]; then echo "usage: torchrun [--nnodes NNODES] [--nproc-per-node NPROC] ..."; exit 0; fi
exec {VENV_BIN}/torchrun "$@"
""")
        old_torchrun.chmod(0o755)
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"""#!/bin/bash
for gpu in 0 1; do
    case "$*" in
        *name,memory.total,driver_version*) echo "Planted GPU, {mib} MiB, 0.0" ;;
        *memory.total*) echo {mib} ;;
    esac
done
""")
        smi.chmod(0o755)
        site = self.folder / "site" / f"{name}.sh"
        site.write_text(f"source {self.site}\nexport PATH={bin_dir}:$PATH\n")
        return site

    def wait(self, *names, timeout=900):
        """Wait for these jobs; return (scontrol's record, log text) for each, in order."""
        records = self.cluster.wait([self.ids[n] for n in names], timeout=timeout)
        return [(records[self.ids[n]], self.logs[n].read_text(errors="replace") if self.logs[n].exists() else "")
                for n in names]

    def steps(self, name):
        return [json.loads(line)["step"] for line in (self.outs[name] / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def jobs(slurm_cluster, tiny_model, tmp_path_factory):
    """Every job of this module, queued at once (the module's docstring says in what order); the
    tests wait for theirs."""
    jobs = Jobs(slurm_cluster, tmp_path_factory.mktemp("submit"), tiny_model)
    timed = queue_timed(jobs, slurm_cluster)
    jobs.watcher = slurm_cluster.hold_back_after(timed)  # ends once it has held the jobs back
    queue_background(jobs, after=timed)
    return jobs


def queue_timed(jobs: Jobs, cluster) -> list[int]:
    """The jobs whose tests send a signal or wait for SLURM's clock: a warning must find the ranks
    where the test expects them, and a time limit must not end a start that a busy machine slowed
    down. Returns their ids."""
    # The time limit's own warning: 2 minutes, USR1 30 s before the end. slurmctld looks at its
    # clock every 30 s and sends the warning up to 30 s early, so it comes 60-90 s into a start.
    # The ranks hold after step 3, the last, until it does (MINIDIST_PAUSE_AT, preemption.py), so
    # the next start has only to load the checkpoint and finish. Queued first: it mostly waits.
    # PyTorch's FSDP2, the reference (IMPL=torch), so that its path keeps running under SLURM too.
    jobs.submit("time-limit", "chess_finetune.sh", "--max_steps", "3", *SMALL, "--no_save",
                options=[*SMALL_JOB, "--time=2", "--signal=B:USR1@30"], env={"MINIDIST_PAUSE_AT": "step:3", "IMPL": "torch"})
    # One node, two CPUs for srun's task (a whole node here), evaluation, a checkpoint per step...
    cpus = min(2, cluster.cpus_per_node)
    # (NCCL_SOCKET_IFNAME set but empty: not passed on as "".)
    one_node = jobs.submit("one-node", "chess_finetune.sh", "--max_steps", "2", "--max_seq_length", "48",
                           "--eval_prefixes", "8", "--save_steps", "1",
                           options=[f"--cpus-per-task={cpus}", "--gpus-per-node=2", "--mem=2G"],
                           env={"NCCL_SOCKET_IFNAME": ""})
    # ...then, in the same folder, a job warned before its ranks even started: from checkpoint-2 on.
    jobs.submit("early-warning", "chess_finetune.sh", "--max_steps", "4", *SMALL, "--no_save",
                options=[*SMALL_JOB, f"--dependency=afterok:{one_node}"], output_dir=jobs.outs["one-node"])
    cluster.signal_when(jobs.ids["early-warning"], jobs.logs["early-warning"], "(start 1)")
    # Two nodes, one rank each, and a warning sent by hand while the ranks hold after step 3; the
    # NCCL network settings a two-node job may need (unused by gloo: only seen on every node).
    jobs.submit("preempted", "chess_finetune.sh", "--max_steps", "6", *SMALL, "--checkpoint_format", "full",
                options=["--nodes=2", "--cpus-per-task=1", "--gpus-per-node=1", "--mem=2G"],
                env={"MINIDIST_PAUSE_AT": "step:3", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_HCA": "mlx5_0"})
    cluster.signal_when(jobs.ids["preempted"], jobs.logs["preempted"], "paused at step 3")
    return [jobs.ids[name] for name in TIMED]


def queue_background(jobs: Jobs, after: list[int]) -> None:
    """Every lesson script, and the jobs that stop before any training, each to start once the jobs
    `after` have finished, at `BACKGROUND_NICENESS`."""
    then = f"--dependency=afterany:{':'.join(map(str, after))}"
    background = {"niceness": BACKGROUND_NICENESS}
    # Jobs that stop before any training, in a second: one line and exit status 2.
    jobs.submit("no-gpus", "chess_finetune.sh", options=["--gpus-per-node=0", "--cpus-per-task=1", "--mem=1G", then],
                **background)
    jobs.submit("not-divisible", "chess_finetune.sh", options=["--gres=gpu:2", "--cpus-per-task=1", "--mem=1G", then],
                env={"TOTAL_BATCH_SIZE": "10", "BATCH_SIZE_PER_DEVICE": "4"}, **background)
    # GPUs of 4 GiB (a planted nvidia-smi): less than the estimate's 5 GB reserve alone, so nothing fits.
    jobs.submit("gpus-too-small", "chess_finetune.sh", options=["--gpus-per-node=2", "--cpus-per-task=1", "--mem=1G", then],
                env={"SITE_SETUP": str(jobs.planted_gpus("small-gpus", 4096))}, **background)
    # Tensor parallelism across 2 nodes of 1 "GPU" each: refused before anything starts.
    jobs.submit("tp-across-nodes", "chess_finetune.sh", "--tp_size", "2",
                options=["--nodes=2", "--gpus-per-node=1", "--cpus-per-task=1", "--mem=1G", then], **background)
    (jobs.folder / "a-file").write_text("not a folder")  # so no HF_HOME can be made under it
    jobs.submit("no-model-cache", "chess_finetune.sh", options=["--gpus-per-node=1", "--cpus-per-task=1", "--mem=1G", then],
                env={"SCRATCH": str(jobs.folder / "a-file" / "scratch")}, **background)
    # Only the "80 GB" node, asked for as the script's header says: SLURM's own variable. And no
    # OUTPUT_DIR: the script's default, under SCRATCH.
    jobs.submit("gpu80", "chess_finetune.sh", "--max_steps", "1", *SMALL, "--no_save", options=[*SMALL_JOB, then],
                env={"SBATCH_CONSTRAINT": "gpu80"}, output_dir=False, **background)
    # And only the other node: a job that stops at once (3 sequences do not divide over 1 x 2).
    jobs.submit("gpu40", "chess_finetune.sh", options=["--gpus-per-node=1", "--cpus-per-task=1", "--mem=1G", then],
                env={"SBATCH_CONSTRAINT": "gpu40", "TOTAL_BATCH_SIZE": "3"}, **background)
    for script in LESSON_SCRIPTS:
        lesson = LESSONS.get(script.stem, {})
        jobs.submit(script.stem, script.name, *lesson.get("args", FINETUNE_ARGS), options=[*SMALL_JOB, then],
                    env=lesson.get("env"), **background)


def test_the_jobs_are_queued_first(jobs, slurm_cluster):
    """The first test of the session whenever this module is in it: SLURM took every job (sbatch
    answered with its id), the controller knows each by its name, and the background ones wait for
    the timed ones. Where the cluster could make its idle-only cgroup, the slurmd, which start every
    job, are in it: not held back, the background jobs took their fair share of the cores, and the
    other tests beside them ran up to 14 times slower in one run (the benchmarks' sweep: 174 s where
    it took 12), each job step being a session of its own, which Linux gives as much as the whole of
    pytest."""
    known = slurm_cluster.jobs()
    assert {name: known[job]["JobName"] for name, job in jobs.ids.items()} == {name: name for name in jobs.ids}
    timed = {jobs.ids[name] for name in TIMED}
    for name, job in jobs.ids.items():
        if job not in timed:
            assert set(re.findall(r"\d+", known[job]["Dependency"])) >= {str(j) for j in timed}, known[job]
    if slurm_cluster.group is not None:
        slurmd = {(slurm_cluster.root / f"slurmd-{node}.pid").read_text().split()[0] for node in slurm_cluster.nodes}
        assert slurmd <= set((slurm_cluster.group / "cgroup.procs").read_text().split())


def test_the_background_jobs_ran_held_back(jobs, slurm_cluster):
    """Once the timed jobs had finished, the cluster held its jobs back (`hold_back_after`)."""
    jobs.wait(*TIMED)
    jobs.watcher.join(timeout=60)
    if slurm_cluster.group is not None:
        assert (slurm_cluster.group / "cpu.idle").read_text().strip() == "1"


@pytest.mark.parametrize("script", LESSON_SCRIPTS, ids=lambda p: p.stem)
def test_every_lesson_script_runs_under_slurm(jobs, script):
    lesson = LESSONS.get(script.stem, {})
    [(record, log)] = jobs.wait(script.stem)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert "Traceback" not in log, log
    # The site's set-up, once, before anything ran Python: the estimate (00), a node's line, the training.
    assert f"site set-up: sourcing {jobs.site}" in log and log.count(SITE_SOURCED) == 1, log
    assert f" at niceness {BACKGROUND_NICENESS}\n" in log, log  # the batch shell runs at sbatch's niceness
    python = [log.find(text) for text in ("lesson 00: the memory estimate", "\nnode ", " x cpu") if text in log]
    assert python and log.index(SITE_SOURCED) < min(python), log
    for line in lesson.get("log", []):
        assert line in log, f"{script.name}: expected {line!r} in its log:\n{log}"
    if lesson.get("trains", True):
        assert jobs.steps(script.stem) == [1, 2]
    if "latest" in lesson:  # the checkpoint the next start would resume from
        assert (jobs.outs[script.stem] / "latest").read_text() == lesson["latest"] + "\n"


def test_the_two_node_lesson_sends_less_across_nodes_with_hsdp(jobs):
    """slurm/10_multinode.sh on 2 nodes x 2 ranks: flat FSDP's ring crosses nodes on ranks 1 and 3,
    which send all of theirs across; under HSDP every rank sends only its shard's all-reduce across,
    and with LoRA only the adapters' shard crosses."""
    [(record, log)] = jobs.wait("10_multinode")
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert log.count(STORE_UP) == 3, log  # a fresh rendezvous store for each run: the first one's closed its rendezvous
    runs = {s: [json.loads(line) for line in (jobs.outs["10_multinode"] / s / "metrics.jsonl").read_text().splitlines()]
            for s in ("fsdp", "hsdp", "hsdp-lora")}
    assert [r["step"] for r in runs["fsdp"]] == [r["step"] for r in runs["hsdp"]] == [1, 2]
    assert [r["step"] for r in runs["hsdp-lora"]] == [1, 2]
    for flat, hybrid, lora in zip(runs["fsdp"], runs["hsdp"], runs["hsdp-lora"]):
        assert flat["comm_bytes_across_nodes_by_rank"][0] == 0 < flat["comm_bytes_across_nodes_by_rank"][1]
        assert len(set(hybrid["comm_bytes_across_nodes_by_rank"])) == 1
        assert max(hybrid["comm_bytes_across_nodes_by_rank"]) < max(flat["comm_bytes_across_nodes_by_rank"])
        assert len(set(lora["comm_bytes_across_nodes_by_rank"])) == 1
        assert 0 < max(lora["comm_bytes_across_nodes_by_rank"]) < max(hybrid["comm_bytes_across_nodes_by_rank"]) / 10


def test_chess_finetune_trains_on_one_node_with_the_cpus_it_asked_for(jobs):
    [(record, log)] = jobs.wait("one-node")
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), log
    # 8 = 2 per device x 2 ranks x 2 accumulation steps, computed by the script.
    assert "1 node(s) x 2 GPUs" in log and "total batch 8 = 2 x 2 x 2 accumulation" in log
    assert "minidist/fsdp on 2 x cpu" in log and "step    2/2" in log  # the hand-written FSDP by default
    assert "--pack: sdpa with a block-diagonal causal mask" in log  # games packed into rows by default (PACK=1)
    assert "legal-move rate after training" in log
    # The model cache under SCRATCH, made by the script; one line for the node, with NCCL's warnings
    # on and no other network variable (the empty NCCL_SOCKET_IFNAME was not passed on); no GPU constraint.
    scratch = jobs.folder / "scratch"
    assert f"model cache: HF_HOME={scratch}/hf" in log and (scratch / "hf").is_dir(), log
    nodes = node_lines(log)
    assert list(nodes) == [record["NodeList"]] and nodes[record["NodeList"]][1] == "NCCL_DEBUG=WARN", log
    # The flight recorder's folder, where a rank that times out in a collective writes its last ones.
    assert (jobs.outs["one-node"] / "nccl-trace").is_dir()
    assert "GPU constraint: none" in log
    assert (jobs.outs["one-node"] / "model" / "config.json").exists()
    # slurmd prints the cores it binds each task to: the batch shell's, then srun's one task.
    # srun must get the job's --cpus-per-task (SLURM >= 22.05 no longer passes it on by itself).
    masks = re.findall(r"cpu-bind=MASK - \S+, task +\d+ +\d+ \[\d+\]: mask (0x[0-9a-f]+) set", log)
    cpus = int(record["NumCPUs"])
    assert len(masks) >= 2 and [bin(int(m, 16)).count("1") for m in masks] == [cpus] * len(masks), log


def test_two_nodes_stop_at_a_warning_requeue_and_resume(jobs, slurm_cluster):
    """A warning sent by hand while both nodes' ranks hold after step 3: the batch shell passes it
    to srun, which passes it to every process of the step on both nodes; they save checkpoint-3
    together, the script requeues the job, and SLURM starts it again with the same id."""
    [(record, log)] = jobs.wait("preempted")
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    first, second = starts(log)
    head = slurm_cluster.run("scontrol", "show", "hostnames", record["NodeList"]).stdout.split()[0]
    assert f"2 node(s) x 1 GPUs, rendezvous {head}:" in first
    # More than one node and no strategy asked for: hybrid sharding, one rank per copy here.
    assert "2 nodes: hybrid sharding (--strategy hsdp)" in first and "minidist/hsdp on 2 x cpu" in first
    # One line per node, each with the NCCL settings as the ranks there see them.
    nodes = slurm_cluster.run("scontrol", "show", "hostnames", record["NodeList"]).stdout.split()
    assert {name: network for name, (_, network) in node_lines(first).items()} == {
        name: "NCCL_DEBUG=WARN NCCL_IB_HCA=mlx5_0 NCCL_SOCKET_IFNAME=lo" for name in nodes}, first
    assert set(node_lines(second)) == set(nodes), second
    # Each node's torchrun publishes the address SLURM reaches it at (NodeAddr, 127.0.0.1 here), not
    # its host name, and gloo uses the interface that holds it (allocation.sh's node_addresses).
    for start in (first, second):
        for name in nodes:
            assert f"node {name}: torchrun --local-addr 127.0.0.1, gloo on lo\n" in start, start
    out = jobs.outs["preempted"]
    assert "USR1: the time limit is near; asking the training to save and stop" in first
    assert first.count("stopped by SIGUSR1 after step 3: saved") == 1, first
    assert f"requeueing job {jobs.ids['preempted']}; the next start resumes from {out}/checkpoint-3" in first
    assert "step    4/6" not in first
    assert f"job {jobs.ids['preempted']} (start 2)" in second
    assert f"resumed from {out / 'checkpoint-3'} at step 3" in second and "step    6/6" in second
    assert jobs.steps("preempted") == [1, 2, 3, 4, 5, 6]
    from transformers import AutoModelForCausalLM  # the full form: a Hugging Face folder
    assert AutoModelForCausalLM.from_pretrained(out / "checkpoint-3" / "model").config.hidden_size == 64


def test_the_time_limit_warning_stops_requeues_and_resumes(jobs):
    """No scancel here: slurmctld itself sends USR1 before the 2-minute limit (`--signal=B:USR1@30`)."""
    [(record, log)] = jobs.wait("time-limit")
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert int(record["Restarts"]) >= 1, log
    first, *later = starts(log)
    assert "torch/fsdp on 2 x cpu" in first  # IMPL=torch: PyTorch's FSDP2
    assert "USR1: the time limit is near" in first
    stopped = re.search(r"stopped by SIGUSR1 after step (\d): saved (\S+);", first)
    assert stopped, first
    step, checkpoint = stopped.groups()
    assert f"requeueing job {jobs.ids['time-limit']}; the next start resumes from {checkpoint}" in first
    assert f"resumed from {checkpoint} at step {step}" in later[0]
    assert jobs.steps("time-limit") == [1, 2, 3]


def test_a_warning_as_a_start_begins_loses_nothing(jobs):
    """The warning comes as the start begins (sent once "(start 1)" is logged). Wherever it lands,
    nothing is lost and no step runs twice: before srun, the script requeues at once; before srun's
    tasks started, srun drops it and the stop file stops the ranks after their first step, with a
    checkpoint (a CI run landed there); before the ranks installed their handler, they die of it,
    having trained nothing since checkpoint-2. The next start goes on from what this one left."""
    (_, _), (record, log) = jobs.wait("one-node", "early-warning")
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    first, second = starts(log)
    out = jobs.outs["early-warning"]
    assert "USR1: the time limit is near" in first, first
    resumes_from = re.search(r"the next start resumes from (\S+)", first).group(1)
    stopped = re.search(r"stopped by .* after step (\d): saved (\S+);", first)
    assert resumes_from == (stopped.group(2) if stopped else f"{out}/checkpoint-2"), first
    step = resumes_from.rsplit("-", 1)[1]
    assert f"resumed from {resumes_from} at step {step}" in second and "step    4/4" in second, second
    assert jobs.steps("early-warning") == [1, 2, 3, 4]


def test_jobs_sharing_a_node_get_their_own_rendezvous_port(jobs):
    """A fixed port (29500) made a second job on the same head node fail or join the first one's
    rendezvous store; the port comes from the job id."""
    names = ["one-node", "preempted", "time-limit", "01_collectives", "02_ddp", "03_accumulation"]
    ports = {}
    for name, (_, log) in zip(names, jobs.wait(*names)):
        port = int(re.search(r"rendezvous \S+:(\d+)", log).group(1))
        assert port == 20000 + jobs.ids[name] % 10000
        ports[name] = port
    assert len(set(ports.values())) == len(names)


def test_a_job_without_gpus_stops_with_one_line(jobs):
    [(record, log)] = jobs.wait("no-gpus")
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "2:0"), log
    assert log.strip().splitlines()[-1].startswith(f"error: job {jobs.ids['no-gpus']} has no GPUs"), log
    assert "Traceback" not in log and "line " not in log, log


def test_sizes_that_do_not_divide_stop_the_job_with_one_line(jobs):
    # --gres=gpu:2, the older way to ask for GPUs, counts as 2 GPUs too.
    [(record, log)] = jobs.wait("not-divisible")
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "2:0"), log
    assert log.strip().splitlines()[-1] == (
        "error: TOTAL_BATCH_SIZE=10 is not divisible by 2 GPUs x BATCH_SIZE_PER_DEVICE=4; pick sizes whose product divides it")


def test_gpus_too_small_for_the_estimate_stop_the_job_before_loading_with_one_line(jobs):
    """Every node's nvidia-smi (planted) says 4,096 MiB; the estimate of the run and its reserve do
    not fit, and the job stops in one line, before any model loads, naming the figures. Every other
    job here has no nvidia-smi, and says it did not check."""
    [(record, log)] = jobs.wait("gpus-too-small")
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "2:0"), log
    line = log.strip().splitlines()[-1]
    assert line.startswith("error: the estimated peak, ") and " MB per GPU, and 5.00 GB for what it leaves out" in line, log
    assert "are more than the 4.29 GB of the smallest GPU here: the run would stop, out of memory" in line, log
    assert "what fits (estimated peak): none of --accumulate_sharded" in line and "step " not in log, log
    # Its planted torchrun is an old one: the script read its flags and said what it cannot do.
    assert "warning: this torchrun cannot pass SLURM's warning (USR1) on to its workers" in log, log
    [(_, other)] = jobs.wait("gpu80")
    assert "GPU memory: not checked (no nvidia-smi on the nodes)" in other, other


def test_tensor_parallelism_across_nodes_stops_the_job_with_one_line(jobs):
    [(record, log)] = jobs.wait("tp-across-nodes")
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "2:0"), log
    assert log.strip().splitlines()[-1].startswith(
        "error: --tp_size 2 does not divide the 1 GPUs of a node: its groups would span nodes"), log
    assert "Traceback" not in log and not re.search(r"line \d+", log), log  # no shell error either


def test_a_model_cache_that_cannot_be_made_stops_the_job_with_one_line(jobs):
    [(record, log)] = jobs.wait("no-model-cache")
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "2:0"), log
    assert log.strip().splitlines()[-1] == (
        f"error: cannot create HF_HOME={jobs.folder}/a-file/scratch/hf: set SCRATCH (then HF_HOME is $SCRATCH/hf) "
        "or HF_HOME to a folder you can write, with room for the model (13.5 GB for CodeLlama-7b)"), log


def test_a_gpu_constraint_picks_the_nodes_that_have_it(jobs, slurm_cluster):
    """SBATCH_CONSTRAINT=gpu80 (what the script's header says to use for 80 GB GPUs): the job runs
    on the one node with that feature, and says so; one asking for gpu40 runs on the other node
    (the two together are no accident of scheduling); a feature no node has is refused by sbatch."""
    (record, log), (other, _) = jobs.wait("gpu80", "gpu40")
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), log
    node_with = {feature: node for node, feature in slurm_cluster.features.items()}
    assert record["Features"] == "gpu80" and record["NodeList"] == node_with["gpu80"], record
    assert list(node_lines(log)) == [node_with["gpu80"]] and "GPU constraint: gpu80" in log and "step    1/1" in log, log
    assert other["Features"] == "gpu40" and other["NodeList"] == node_with["gpu40"] != node_with["gpu80"], other
    with pytest.raises(subprocess.CalledProcessError) as refused:
        jobs.submit("gpu120", "chess_finetune.sh", options=SMALL_JOB, env={"SBATCH_CONSTRAINT": "gpu120"})
    assert "Invalid feature specification" in refused.value.stderr, refused.value.stderr


def test_outputs_go_to_scratch_and_the_room_is_said_before_the_first_save(jobs):
    """A job that sets no OUTPUT_DIR writes under $SCRATCH/minidist/runs/chess-<job id>, not under
    the folder it was submitted from, and says so; after its first step the run says how big a
    checkpoint is, how much it writes at most (SAVE_STEPS 100 over 1 step: one save, a stop's),
    and what the disk has free."""
    [(record, log)] = jobs.wait("gpu80")
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), log
    out = jobs.outs["gpu80"]
    assert f"outputs: OUTPUT_DIR={out}\n" in log and jobs.steps("gpu80") == [1], log
    assert not list(jobs.folder.glob("runs")), "nothing under the submission folder"
    room = re.search(r"^disk: a checkpoint holds ([\d.]+) MB and no fine-tuned model \(--no_save\); this start writes "
                     r"up to ([\d.]+) MB more \(1 checkpoint, if a stop signal asks for it \(--save_steps saves none in "
                     rf"this start\)\); {re.escape(str(out))} has [\d.]+ [GT]B free", log, re.M)
    assert room and room[1] == room[2], log
    assert log.index("step    1/1") < room.start(), log  # after the first step


# -- without a cluster: the scripts run with bash, as a learner might by mistake ---------------

def run_script(script, folder=SLURM, **env):
    """Run a script with bash outside SLURM; no site set-up unless SITE_SETUP is given (a learner's
    own slurm/site.sh stays out of the tests)."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"SITE_SETUP": ""} | env
    variables = {k: v for k, v in variables.items() if v is not None}  # None: leave it unset
    return subprocess.run(["bash", str(folder / script)], env=variables, capture_output=True, text=True, timeout=60)


# The scripts that load the fp32 model on every rank (DDP, ZeRO, tp under DDP): they alone take the node's memory.
EVERY_RANK_LOADS = {"00_memory", "02_ddp", "04_zero", "11_tensor_parallel"}


@pytest.mark.parametrize("script", [SLURM / "chess_finetune.sh", *LESSON_SCRIPTS], ids=lambda p: p.stem)
def test_only_the_scripts_that_load_on_every_rank_take_the_whole_nodes_memory(script):
    """`#SBATCH --mem=0` takes all of a node's memory, and with it, on most sites, the node's other
    GPUs: an 8-GPU node for a 4-GPU job. Rank-0 loading (both FSDPs) reads 27 GB once, so those
    scripts ask for 96 GB; a script that keeps --mem=0 says why in the comment above the line."""
    lines = script.read_text().splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("#SBATCH --mem=")]
    if script.stem in EVERY_RANK_LOADS:
        assert lines[at] == "#SBATCH --mem=0" and "on every rank" in lines[at - 1], lines[at - 1:at + 1]
    elif script.stem != "01_collectives":  # no model at all: 64 GB
        assert lines[at] == "#SBATCH --mem=96G", lines[at]


@pytest.mark.parametrize("script", ["chess_finetune.sh", "01_collectives.sh", "02_ddp.sh"])
def test_outside_slurm_a_script_says_so_in_one_line(script):
    done = run_script(script)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: this is a SLURM batch script and SLURM_JOB_ID is not set: submit it with sbatch "
        "(on one machine, run torchrun -m minidist.finetune directly: see README.md)"]


@pytest.mark.parametrize("name,value,least", [("TOTAL_BATCH_SIZE", "abc", 1), ("TOTAL_BATCH_SIZE", "0", 1),
                                              ("BATCH_SIZE_PER_DEVICE", "2.5", 1), ("BATCH_SIZE_PER_DEVICE", "four", 1),
                                              ("SAVE_STEPS", "-1", 0)])
def test_a_bad_batch_variable_is_one_line(name, value, least):
    done = run_script("chess_finetune.sh", **{name: value})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: {name}={value} must be a whole number of at least {least}"]


def test_a_bad_impl_is_one_line():
    done = run_script("chess_finetune.sh", IMPL="fsdp2")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: IMPL=fsdp2 must be minidist (FSDP by hand) or torch (PyTorch's FSDP2)"]


def test_a_bad_pack_is_one_line():
    done = run_script("chess_finetune.sh", PACK="yes")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: PACK=yes must be 1 (whole games packed into rows) or 0 (every game padded)"]


def test_the_site_set_up_is_slurm_site_sh_by_default_or_the_file_site_setup_names(tmp_path):
    """The hook is sourced first, before the script even finds it is outside SLURM: slurm/site.sh
    beside the scripts by default (here in a copy of slurm/), or the file SITE_SETUP names; a
    missing file or one that ends with an error is one line."""
    folder = tmp_path / "repository" / "slurm"
    shutil.copytree(SLURM, folder)
    (folder / "site.sh").write_text('echo "site.sh: sourced"\n')
    (tmp_path / "mine.sh").write_text('echo "mine.sh: sourced"\n')
    # A site file whose last command failed (say, `conda activate` of an environment that is not there).
    (tmp_path / "broken.sh").write_text('echo "activating"\nfalse\n')
    outside = ["error: this is a SLURM batch script and SLURM_JOB_ID is not set: submit it with sbatch "
               "(on one machine, run torchrun -m minidist.finetune directly: see README.md)"]
    default = run_script("chess_finetune.sh", folder, SITE_SETUP=None)
    named = run_script("chess_finetune.sh", folder, SITE_SETUP=str(tmp_path / "mine.sh"))
    for done, site in ((default, folder / "site.sh"), (named, tmp_path / "mine.sh")):
        assert (done.returncode, done.stderr.splitlines()) == (2, outside), done.stderr
        assert done.stdout.splitlines()[:2] == [f"site set-up: sourcing {site}", f"{site.name}: sourced"], done.stdout
    missing = run_script("chess_finetune.sh", folder, SITE_SETUP=str(tmp_path / "nowhere.sh"))
    assert (missing.returncode, missing.stderr.splitlines()) == (2, [
        f"error: SITE_SETUP={tmp_path / 'nowhere.sh'} is not a file: name the site set-up to source "
        "(module load, conda activate), or leave SITE_SETUP empty for none"]), missing.stderr
    broken = run_script("chess_finetune.sh", folder, SITE_SETUP=str(tmp_path / "broken.sh"))
    assert broken.returncode == 2 and broken.stderr.splitlines()[-1] == (
        f"error: the site set-up {tmp_path / 'broken.sh'} ended with status 1: fix it, or submit with "
        "SITE_SETUP= to skip it"), broken.stderr


def test_each_node_publishes_the_address_slurm_reaches_it_at(tmp_path):
    """`node_addresses` (allocation.sh): torchrun on a node is started with --local-addr set to the
    node's NodeAddr, and that is the MASTER_ADDR the workers of every node are told to connect to
    (by default torch publishes `socket.getfqdn()`, here "localhost", a name another node may not
    resolve). 127.0.0.2 is loopback too, so the workers reach it; SLURM's answers are planted."""
    planted = """scontrol() {
        case "$1 $2" in
            "show hostnames") echo vm ;;
            "show node") echo "NodeName=vm Arch=x86_64"; echo "   NodeAddr=127.0.0.2 NodeHostName=vm Version=24.11" ;;
        esac
    }"""
    port = str(20000 + os.getpid() % 10000)
    script = (f"{planted}\nsource {SLURM}/allocation.sh\nnode_addresses\n"
              f'SLURMD_NODENAME=vm bash -c "$TORCHRUN_HERE" torchrun --nnodes 1 --nproc_per_node 1 '
              f"--rdzv_backend c10d --rdzv_endpoint 127.0.0.1:{port} --no-python "
              f"python -c \"import os; print('workers connect to', os.environ['MASTER_ADDR'])\"")
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "PET_LOCAL_ADDR")}
    done = subprocess.run(["bash", "-c", script], env=env | {"SLURM_JOB_NODELIST": "vm"}, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "node vm: torchrun --local-addr 127.0.0.2, gloo on the interface of the host name\n" in done.stdout
    assert "workers connect to 127.0.0.2\n" in done.stdout, done.stdout + done.stderr


def test_a_compressed_node_list_gives_its_first_node_as_the_rendezvous(slurm_cluster):
    """SLURM writes node lists compressed ("gpu[01-04,07]"); the real `scontrol show hostnames`
    expands them, and the first name is the head node. The two nodes here never compress, so the
    list is given by hand to the scripts' own `read_allocation` (slurm/allocation.sh)."""
    variables = {k: v for k, v in slurm_cluster.env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    variables |= {"SLURM_JOB_ID": "123", "SLURM_JOB_NUM_NODES": "5", "SLURM_JOB_NODELIST": "gpu[01-04,07]",
                  "SLURM_GPUS_ON_NODE": "4"}
    done = subprocess.run(["bash", "-c", f"source {SLURM / 'allocation.sh'}; read_allocation; "
                           "echo $NNODES $GPUS_PER_NODE $HEAD_NODE $MASTER_PORT; scontrol show hostnames \"$SLURM_JOB_NODELIST\""],
                          env=variables, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["5", "4", "gpu01", "20123", "gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
