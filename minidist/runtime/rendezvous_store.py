"""The rendezvous store of a multi-node job, in a process of its own: `python -m minidist.runtime.rendezvous_store PORT`.

What it is. torchrun's c10d rendezvous is a key-value store (`torch.distributed.TCPStore`): one
process holds the keys and listens on a port, every node's torchrun agent connects to it. Through it
the agents agree on who is in the job and which node gets which ranks, send their heartbeats, and
at the end meet at an exit barrier, so that no agent leaves while another still runs its workers.

Why it lives in its own process. By default the agent on the head node hosts the store itself
(`is_host` from its hostname, torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py), so
the store lives exactly as long as that agent. The exit barrier counts the agents in (`add`) and
then waits for the key the last one sets (`wait`). When the head's agent is the last to count in,
it sets the key, passes, exits, and takes the store with it; an agent that counted in just before
but has not yet asked for the key (a loaded node, a slow network) finds the store gone and logs
"Error waiting on exit barrier" with a traceback, at the end of a job that trained to its last step:
torch's open issue https://github.com/pytorch/pytorch/issues/69520. Here the batch script starts this
process on the head node before `srun`, every torchrun joins as a client (`--rdzv_conf is_host=0`),
and the script stops the store once srun has returned, after every agent has left.

torchrun keeps a rendezvous's state under its `--rdzv_id`, and a rendezvous once closed stays
closed: a launch that reuses an id needs a fresh store (lesson 10 runs slurm/chess_finetune.sh three
times in one job, with the job's id: each run starts its own store, and stops it when it is done).

The line it writes to the file named by `--ready` (or to stdout) says that the port is bound: the
batch script waits for it before it starts the agents. A port already taken is one line, exit 2.
"""

import argparse
import signal
import socket
import sys
from pathlib import Path


def serve(port: int, ready: Path | None = None) -> None:
    """Host the store on `port` (every interface) until SIGTERM or SIGINT; say so once it listens."""
    import torch.distributed as dist

    # A clean exit on the signal that stops it, instead of Python's KeyboardInterrupt traceback.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda signum, frame: sys.exit(0))
    # SLURM's time-limit warning (USR1) is for the training, which saves then: the store must outlive it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        # The server binds the port on every interface; host_name is only where this process's own
        # client connects. No fixed number of clients to wait for: agents come and go.
        store = dist.TCPStore("localhost", port, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError) as error:  # DistNetworkError, a RuntimeError: the port is taken
        print(f"error: the rendezvous store cannot listen on port {port}: {str(error).splitlines()[0]}",
              file=sys.stderr)
        sys.exit(2)
    line = f"rendezvous store: listening on {socket.gethostname()}:{store.port}"
    if ready is None:
        print(line, flush=True)
    else:
        try:
            ready.write_text(line + "\n")
        except OSError as error:  # no such folder, no permission, a full disk: the script would wait for ever
            print(f"error: cannot write --ready {ready} ({error.strerror}); pass a file in a folder that exists",
                  file=sys.stderr)
            sys.exit(2)
    while True:
        signal.pause()  # the handlers above end it


def _port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: argparse's one line for anything else (TCPStore would raise on 70000)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (a whole number from 0, any free one, to 65535)")
    return port


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minidist.runtime.rendezvous_store", description=__doc__.split("\n")[0])
    parser.add_argument("port", type=_port, help="the port torchrun's --rdzv_endpoint names (0: any free one)")
    parser.add_argument("--ready", type=Path, help="write the listening line to this file (default: stdout)")
    args = parser.parse_args(argv)
    serve(args.port, args.ready)


if __name__ == "__main__":
    main()
