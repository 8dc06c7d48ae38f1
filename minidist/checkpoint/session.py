"""One run's checkpoints and stop signals, from the claim of its folder to its final model.

The loop (`finetune.py`) asks five things of this wing (lesson 08), and `Session` answers them in
the order a run meets them:

1. **The folder.** `with Session(...):` the output folder is this run's alone (`output_dir.py`:
   the lock, another run's checkpoints refused), and the handlers the stop signals had before are
   put back on the way out, even when an error ends the run (`preemption.handlers_kept`).
2. **The checkpoint to resume**, found and verified before the model loads (`check_resume`, with
   `state.find` and `state.verify`): a wrong one costs one line, not a model load.
3. **The stop signals**, caught from then on (`catch_stop_signals`: `preemption.StopSignals`),
   until the model is written.
4. **After every step** (`after_step`) the ranks vote on a stop, and save a checkpoint together
   every `--save_steps` and when any of them was asked to stop (`state.Checkpointer`). After the
   first step of each start, before any save, the disk is checked for room: a checkpoint's size,
   counted from the state a save writes, times the number on the disk at once, and the model
   (`disk_room.py`, one line; a run that will not fit stops there, not at its third save).
5. **At the end**, the fine-tuned model (`write_final_model`: `final_model.py`); or, when a signal
   stopped the run, the line that says which checkpoint holds it all (`say_stopped`).

The end is no safe harbour: the final evaluation takes seconds to minutes, the write of a 7B model
as long, and a scheduler's SIGTERM comes when it comes. So the ranks vote after the evaluation and
after the write as after a step (`stopped_at_end`): a stop asked during either saves a checkpoint
of the last step (or keeps the one `--save_steps` saved for it) and exits 75, and `--resume` loads
it with no step left to train, so it only evaluates and writes the model. Killed there instead,
a run with the default `--save_steps 0` would lose every step.
"""

from contextlib import ExitStack
from pathlib import Path

import torch.distributed as dist

from minidist.checkpoint import disk_room, final_model, preemption, state
from minidist.checkpoint.output_dir import claimed
from minidist.runtime.distributed import wait_for_rank0
from minidist.runtime.errors import UsageError


class Session:
    """The output folder, checkpoints and stop signals of one run on this rank (see module doc)."""

    def __init__(self, output_dir, env, resume: str | None = None, overwrite: bool = False, save_steps: int = 0,
                 keep: int = 2, form: str = "sharded"):
        self.out, self.env = Path(output_dir), env
        self.metrics_path = self.out / "metrics.jsonl"  # the loop writes it; a checkpoint keeps a copy
        self.resume_from, self.overwrite = resume, overwrite  # --resume, --overwrite_output_dir
        self.save_steps, self.keep, self.form = save_steps, keep, form  # --save_steps, --save_total_limit, ...
        self.run = self.resume_path = self.stop_signals = self.checkpoints = None
        self.stopped = None  # after a stop: the signal, the step and the checkpoint saved
        self.last = None  # the last step done: its number, data position, `extra` and checkpoint (None: unsaved)
        self.room = None  # what `check_room` needs besides the state (`follow`), and whether it ran
        self._held = ExitStack()

    def __enter__(self) -> "Session":
        self._held.enter_context(claimed(self.out, self.env.is_main, self.resume_from, self.overwrite))
        self._held.enter_context(preemption.handlers_kept())
        return self

    def __exit__(self, *exc) -> bool:
        return self._held.__exit__(*exc)

    def check_resume(self, run: dict) -> None:
        """Keep `run`, what a checkpoint must share with this run for a resume to be exact (the
        fingerprint `state.verify` compares); with `--resume`, find and verify the checkpoint now.
        Raises ValueError, in one line, for one that cannot be resumed."""
        self.run = run
        if self.resume_from:
            self.resume_path = state.verify(state.find(self.resume_from, self.out), run)

    def catch_stop_signals(self) -> None:
        """From here SIGTERM, SIGUSR1, SIGINT and SIGHUP (or the stop file, or a dead launcher) mean:
        save after this step, stop."""
        self.stop_signals = preemption.StopSignals()

    def follow(self, strategy, model, optimizer, scheduler, tokenizer, max_steps: int, model_bytes: int) -> None:
        """What a checkpoint saves and a resume loads: the model, its optimizer and scheduler; and
        what the disk check after the first step needs besides: the run's last step and the bytes
        of the fine-tuned model it writes at the end (0 with `--no_save`)."""
        self.checkpoints = state.Checkpointer(self.out, strategy, model, optimizer, scheduler, self.run, self.form,
                                              self.keep, tokenizer)
        self.room = {"max_steps": max_steps, "model_bytes": model_bytes, "checked": False}

    def check_room(self, step: int) -> None:
        """A collective, once per start, after its first step (`step`): the checkpoint's size from
        the state a save writes, then rank 0 compares what the rest of the run writes with the
        output folder's free space (`disk_room.check`) and every rank learns the verdict: rank 0
        prints the line (with `--save_steps`; without, only a stop would save, and the line is kept
        for a run that does not fit), and every rank raises the same UsageError where it does not fit."""
        checkpoint = disk_room.checkpoint_bytes(self.checkpoints.strategy, self.checkpoints.model,
                                                self.checkpoints.optimizer)
        self.room["checked"] = True
        verdict = [None]
        if self.env.is_main:
            saves = disk_room.saves_left(step, self.room["max_steps"], self.save_steps)
            try:
                verdict = [("fits", disk_room.check(self.out, checkpoint, self.room["model_bytes"], saves, self.keep))]
            except UsageError as err:
                verdict = [("does not fit", str(err))]
        if self.env.world_size > 1:
            dist.broadcast_object_list(verdict, src=0)
        fits, line = verdict[0]
        if fits != "fits":
            raise UsageError(line)
        if self.env.is_main and self.save_steps:  # without --save_steps only a stop saves: silent when it fits
            print(line)

    def resume(self) -> dict | None:
        """With `--resume`: load the checkpoint into the model, optimizer, scheduler and RNGs, say so
        on rank 0, and return its step, data position, metrics records and `extra`
        (`Checkpointer.load`). Without: None."""
        if self.resume_path is None:
            return None
        restored = self.checkpoints.load(self.resume_path)
        self.last = {"step": restored["step"], "position": restored["position"], "extra": restored["extra"],
                     "checkpoint": self.resume_path}  # no step may be left: the end needs it
        epoch, offset = restored["position"]
        if self.env.is_main:
            print(f"resumed from {self.resume_path} at step {restored['step']} (data epoch {epoch}, offset {offset})")
        return restored

    def after_step(self, step: int, record: dict, position, extra: dict,
                   diverged: tuple[int, str] | None = None) -> bool:
        """Every rank calls it after every step (`step` counts from 1, as the records do), with the
        data position of the next step, what the checkpoint keeps besides the state (`extra`), and
        what this rank's `divergence.Watch` saw (None: a healthy step). Saves when `--save_steps`
        says so or any rank was asked to stop; True: stop now. A divergence on any rank ends the run
        on every rank, unsaved, in one line (`_diverged`)."""
        preemption.pause_if_asked("step", step)  # a test hook, idle unless MINIDIST_PAUSE_AT says so
        if self.room is not None and not self.room["checked"]:  # the first step of this start: before any save
            self.check_room(step)
        stop, anyone_diverged = self.stop_signals.agreed(self.env.device, diverged is not None)  # all ranks vote
        if anyone_diverged:
            self._diverged(step, diverged)
        self.last = {"step": step, "position": position, "extra": extra, "checkpoint": None}
        if stop or (self.save_steps and step % self.save_steps == 0):
            self.last["checkpoint"] = self.checkpoints.save(step, position, self.metrics_path, extra)
        if stop:
            self.stopped = {"signal": self.stop_signals.received(), "step": step, "checkpoint": self.last["checkpoint"]}
        return stop

    def _diverged(self, step: int, seen: tuple[int, str] | None) -> None:
        """Stop every rank in one line after a divergence. The step it showed in is not saved, and
        neither is any checkpoint whose weights gave it offered to `--resume`: the weights saved after
        step k are the ones step k + 1's loss was computed with, so every checkpoint from the step
        before the first sign on is moved aside (rank 0, `Checkpointer.set_aside`; it tells the
        others) and `latest` names the newest one before them, or nothing. The advice is then true:
        `--resume` goes on from a checkpoint saved before the divergence, and a `--learning_rate`
        given with it rescales the schedule (finetune.py)."""
        first, what = seen or (step, f"another rank saw the run diverge at step {step}")
        found = [self.checkpoints.set_aside(first - 1) if self.env.is_main else None]
        if self.env.world_size > 1:  # every rank says the same line: rank 0's (torchrun may show any rank's)
            dist.broadcast_object_list(found, src=0)
        good, aside = found[0]
        moved = f" (moved aside, as their weights gave it: {', '.join(aside)})" if aside else ""
        if good is not None:
            advice = (f"{self.out / 'latest'} names {good.name}, saved before it{moved}: run again with --resume with "
                      f"a lower --learning_rate (it rescales the saved schedule), or start afresh with "
                      f"--overwrite_output_dir and a lower --learning_rate or more --warmup_steps")
        else:
            advice = (f"no checkpoint was saved before it{moved}: start again with a lower --learning_rate or more "
                      f"--warmup_steps")
        raise UsageError(f"training diverged: {what}; it was not saved, {advice}")

    def stopped_at_end(self, stage: str) -> bool:
        """Every rank calls it after the final evaluation and after the final write (`stage` names
        which): the same vote as after a step. True: a stop was asked during `stage`, and the
        checkpoint of the last step holds the run, saved now unless one was saved for that step
        already (by `--save_steps`, or the one this run resumed from)."""
        if not self.stop_signals.agreed(self.env.device)[0]:
            return False
        kept = self.last["checkpoint"] is not None
        if not kept:
            self.last["checkpoint"] = self.checkpoints.save(self.last["step"], self.last["position"],
                                                            self.metrics_path, self.last["extra"])
        self.stopped = {"signal": self.stop_signals.received(), "step": self.last["step"],
                        "checkpoint": self.last["checkpoint"], "during": stage, "kept": kept}
        return True

    def stop_catching(self) -> None:
        """Put back the handlers the stop signals had before `catch_stop_signals` (once the model is
        written, or the run stopped)."""
        self.stop_signals.restore()

    def say_stopped(self) -> None:
        """On rank 0, after a stop: which signal, after which step, and the checkpoint that was saved."""
        if self.env.is_main:
            preemption.say_stopped(self.stopped["signal"] or "a peer's signal", self.stopped["step"],
                                   self.stopped["checkpoint"], self.stopped.get("during"), self.stopped.get("kept"))

    def write_final_model(self, model, full_state: dict | None, dtype_choice: str, name_or_path: str, tokenizer,
                          rates: dict) -> None:
        """On rank 0: `eval.json` and, unless `full_state` is None (`--no_save`), the fine-tuned model
        in `model/` (`final_model.write`; a full disk ends the run in one line). Every rank calls it:
        the others wait for the write on a barrier with an hour's timeout, as they wait for rank 0's
        load, and not in the vote after it, under the process group's timeout (ten minutes)."""
        preemption.pause_if_asked("write", self.last["step"])  # a test hook, idle unless MINIDIST_PAUSE_AT says so
        if self.env.is_main:
            final_model.write(self.out, model, full_state, dtype_choice, name_or_path, tokenizer, rates)
            if full_state is not None:
                print(f"saved the fine-tuned model to {self.out / 'model'}")
        wait_for_rank0()
