"""The one kind of error a learner should see as one line, not as a traceback.

A wrong flag, a missing file, a size that does not divide, a damaged checkpoint: these are
mistakes fixed by changing an input, and a 40-line traceback only hides the sentence that says
how. Code anywhere in minidist raises `UsageError` with that sentence; the commands catch it and
print it alone, with exit code 2 (argparse's code for a bad command line). Bugs stay tracebacks.
"""


class UsageError(Exception):
    """A mistake the learner fixes by changing a flag, a file or a size: told in one line."""
