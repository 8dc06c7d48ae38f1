"""A throwaway SLURM cluster on this one machine, so that the batch scripts meet the real thing.

A SLURM cluster is a few daemons that trust each other, and a handful of commands:

- `munged` signs and checks credentials. Every message between SLURM's daemons and commands
  carries one, made with a key every machine of the cluster shares (here: a fresh random key).
- `slurmctld`, the controller, holds the queue: it picks nodes for a job, sends the warning signal
  before a time limit (`--signal`), ends jobs at their limit and requeues them.
- `slurmd`, one per compute node, starts a job's batch script (under `slurmstepd`) and the tasks
  of each `srun` step, and delivers signals to them.
- `sbatch`, `srun`, `scontrol` and `scancel` talk to slurmctld; all of them, daemons included,
  read one `slurm.conf` (found through `SLURM_CONF`).

Here both "nodes" are this machine: two slurmd, named after the host and `localhost`, at
127.0.0.1 on their own ports. GPUs are generic resources ("gres") backed by character devices
made with `mknod`: slurmd only checks that the files exist, then hands their indices to a job
(`CUDA_VISIBLE_DEVICES`, `SLURM_GPUS_ON_NODE`). CPU ranks on gloo stand in for the GPUs.

Tasks are bound to cores (`task/affinity`, `TaskPluginParam=Cores`) as many sites do, so a step
that gets fewer CPUs than its job shows it; `Verbose` makes slurmd print each task's mask into the
job's log ("cpu-bind=MASK - vm, task 0 0 [123]: mask 0x3 set"). Each node has this machine's
CPUs, so that the masks name real cores. Like a site with 40 GB and 80 GB A100 nodes, the nodes
carry a feature each, `gpu40` and `gpu80`, which a job asks for with `--constraint` (or
`SBATCH_CONSTRAINT`); `gpu80` is the second node's, the one SLURM fills last, so that a job found
there got there by its constraint more likely than by chance. A requeued job may start again once its credential
expired: `cred_expire=10` makes that 10 s (the default is 120).

Jobs can be held back, so that they run on what the tests leave of the cores (`hold_back`): the
slurmd run in a cgroup of their own, and so does every job they start, whose CPU time Linux gives
only when nothing outside it wants the core (`cpu.idle`, Linux 5.15 and later). Niceness alone does
not do it where the kernel groups processes by session (`sched_autogroup_enabled`, on here): it
shares the CPU fairly between sessions first, and every job step is a session of its own. A job's
processes still take the niceness of the command that submitted them (`PropagatePrioProcess=1`: the
batch shell sbatch's, a step's tasks srun's), which is what holds them back where there is no such
cgroup to make and no autogroup (`sbatch(..., niceness=19)`).

It needs root (slurmd starts jobs as their user) and the Debian/Ubuntu packages `slurmctld
slurmd slurm-client munge`, which `ensure_installed` installs with apt when missing.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def ensure_installed() -> str | None:
    """Install SLURM and munge with apt if they are missing; return why not, if they cannot be."""
    if all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS):
        return None
    if os.geteuid() != 0:
        return "SLURM is not installed, and installing it needs root"
    if not shutil.which("apt-get"):
        return "SLURM is not installed, and there is no apt-get to install it with"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """munged, slurmctld and two slurmd under `root`; `stop()` ends them and removes the folder."""

    def __init__(self, root: Path, gpus_per_node: int = 4, memory_mb: int = 16000):
        self.root = Path(root)
        self.nodes = [socket.gethostname(), "localhost"]
        self.cpus_per_node = os.cpu_count()
        self.gpus_per_node, self.memory_mb = gpus_per_node, memory_mb
        self.features = dict(zip(self.nodes, ("gpu40", "gpu80")))  # node -> its one feature
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.group: Path | None = None  # the slurmd's cgroup (`hold_back`), once made

    # -- putting it together -------------------------------------------------------------------

    def _write_config(self) -> None:
        r = self.root
        for sub in ("state", "log", "dev", *(f"spool/{n}" for n in self.nodes)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        r.chmod(0o755)  # munged refuses a socket in a folder others cannot enter (parents too)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        gres = []
        for i, node in enumerate(self.nodes):
            first = i * self.gpus_per_node
            for minor in range(first, first + self.gpus_per_node):
                device = r / "dev" / f"gpu{minor}"
                if not device.exists():  # 195 is NVIDIA's major number; nothing ever opens these
                    os.mknod(device, 0o600 | 0o020000, os.makedev(195, minor))
            gres.append(f"NodeName={node} Name=gpu File={r}/dev/gpu[{first}-{first + self.gpus_per_node - 1}]")
        (r / "gres.conf").write_text("\n".join(gres) + "\n")  # slurmd reads it beside slurm.conf
        ctld_port = _free_port()
        node_ports = [_free_port() for _ in self.nodes]
        lines = [
            "ClusterName=minidist",
            f"SlurmctldHost={self.nodes[0]}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge.sock,cred_expire=10",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",  # %n: the node's name, so the two slurmd do not share
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_interval=2",  # look at the queue every 1-2 s
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
            "ProctrackType=proctrack/linuxproc",  # a step's processes: the task and its descendants
            "TaskPlugin=task/affinity", "TaskPluginParam=Cores,Verbose",
            "GresTypes=gpu",
            "JobRequeue=1",
            "PropagatePrioProcess=1",  # a job runs at the niceness of its sbatch (and a step at its srun's)
            "MinJobAge=3600",  # keep finished jobs visible to `scontrol show job`
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # trust the node lines below, not the hardware
            "MpiDefault=none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus_per_node} "
                         f"RealMemory={self.memory_mb} Gres=gpu:{self.gpus_per_node} Feature={self.features[node]} "
                         "State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, *command: str) -> None:
        """Start a daemon; it forks into the background and writes its pid file (stop() reads it)."""
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} did not start: {done.stderr.strip()} (logs in {self.root}/log)")

    def start(self, timeout: float = 60) -> None:
        r = self.root
        self._write_config()
        self._daemon("munged", f"--socket={r}/munge.sock", f"--key-file={r}/munge.key",
                     f"--log-file={r}/log/munged.log", f"--pid-file={r}/munged.pid", f"--seed-file={r}/munged.seed")
        self._daemon("slurmctld", "-f", str(self.conf))
        for node in self.nodes:
            self._daemon("slurmd", "-f", str(self.conf), "-N", node)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # both nodes registered and idle
            out = self.run("sinfo", "--noheader", "--format=%T %D", check=False).stdout.split()
            if out == ["idle", str(len(self.nodes))]:
                self.group = self._own_cgroup()
                return
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM nodes did not come up in {timeout} s: {out}; see {r}/log")

    def _own_cgroup(self) -> Path | None:
        """Move the slurmd into a new cgroup with the `cpu.idle` switch, under cgroup v1's cpu
        controller or cgroup v2's root; the jobs they start are born in it. None where no such group
        can be made here (no cgroup file system, none writable, a kernel before 5.15)."""
        for base in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")):
            if not (base / "cgroup.procs").exists():  # not a cgroup hierarchy (v1 mounts a tmpfs above)
                continue
            group = base / self.root.name
            try:
                group.mkdir()
                if not (group / "cpu.idle").exists():
                    raise OSError("no cpu.idle")
                for node in self.nodes:
                    (group / "cgroup.procs").write_text((self.root / f"slurmd-{node}.pid").read_text().split()[0])
                return group
            except OSError:
                self._remove_cgroup(group)
        return None

    def hold_back(self, yes: bool) -> bool:
        """Give the jobs only the CPU time nothing else on this machine wants (yes), or their fair
        share (no); return whether it could be done (a cgroup was made at start)."""
        if self.group is not None:
            (self.group / "cpu.idle").write_text("1" if yes else "0")
        return self.group is not None

    def hold_back_after(self, job_ids) -> threading.Thread:
        """In the background: once these jobs have finished (or an hour has passed), hold the
        cluster's jobs back (`hold_back(True)`)."""
        def watch():
            try:
                self.wait(job_ids, timeout=3600, poll=1)
            finally:
                self.hold_back(True)
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        return thread

    @staticmethod
    def _remove_cgroup(group: Path) -> None:
        """Remove a cgroup once its processes have ended (rmdir: the kernel refuses it before)."""
        for _ in range(50):
            try:
                group.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)

    def stop(self) -> None:
        """Cancel what still runs, end the daemons (by their pid files, never by name), remove it all."""
        if (self.root / "slurmctld.pid").exists():
            self.run("scancel", "--user=root", check=False)  # slurmd's end would leave job steps running
            deadline = time.monotonic() + 30
            while self.jobs_running() and time.monotonic() < deadline:
                time.sleep(0.5)
        for pid_file in ("slurmctld.pid", *(f"slurmd-{n}.pid" for n in self.nodes), "munged.pid"):
            path = self.root / pid_file
            if not path.exists():
                continue
            pid = int(path.read_text().split()[0])
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):  # slurmd ends its jobs' steps first
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
        if self.group is not None:
            self._remove_cgroup(self.group)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- using it ------------------------------------------------------------------------------

    def run(self, *command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=kwargs.pop("env", self.env), capture_output=True, text=True,
                              check=check, timeout=60, **kwargs)

    def sbatch(self, script, *args, options=(), env=None, cwd=None, niceness: int = 0) -> int:
        """Queue a batch script; return its job id. `env` is the environment it runs with (sbatch
        passes the submitter's on to the job). `niceness` (0 to 19): the job's processes run that
        much nicer than this one. Against a process of the same session group, at 19 one gets about
        1.5% of a core that a process at 0 wants (Linux's scheduler weighs nice 19 at 15 and nice 0
        at 1024); against another session under autogroup it gets its session's fair share all the
        same, which is why `hold_back` uses a cgroup."""
        nice = ["nice", "-n", str(niceness)] if niceness else []
        done = self.run(*nice, "sbatch", "--parsable", *options, str(script), *map(str, args),
                        env={**self.env, **(env or {})}, cwd=cwd)
        return int(done.stdout.strip().split(";")[0])

    def jobs(self) -> dict[int, dict]:
        """Every job the controller knows: `scontrol show job`, one line of KEY=VALUE per job."""
        out = self.run("scontrol", "show", "job", "--oneliner", check=False).stdout
        jobs = {}
        for line in out.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "JobId" in fields:
                jobs[int(fields["JobId"])] = fields
        return jobs

    def jobs_running(self) -> bool:
        return any(job.get("JobState") not in FINISHED for job in self.jobs().values())

    def wait(self, job_ids, timeout: float = 600, poll: float = 0.5) -> dict[int, dict]:
        """Poll until every job has finished (`sbatch --wait` would return up to 30 s late)."""
        job_ids = set(job_ids)
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.jobs()
            if all(jobs.get(j, {}).get("JobState") in FINISHED for j in job_ids):
                return {j: jobs[j] for j in job_ids}
            if time.monotonic() > deadline:
                states = {j: jobs.get(j, {}).get("JobState") for j in job_ids}
                raise TimeoutError(f"SLURM jobs not finished after {timeout} s: {states}")
            time.sleep(poll)

    def signal_when(self, job_id: int, log: Path, text: str, sig: str = "USR1", timeout: float = 300):
        """In the background: once `text` appears in `log`, send `sig` to the job's batch shell
        (`scancel --batch`: what `#SBATCH --signal=B:...` does at the time limit, but now)."""
        def watch():
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if log.exists() and text in log.read_text(errors="replace"):
                    self.run("scancel", "--batch", f"--signal={sig}", str(job_id), check=False)
                    return
                time.sleep(0.1)
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        return thread
