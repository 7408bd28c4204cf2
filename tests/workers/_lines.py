"""One line per write(2) call, so lines that several ranks print into one pipe never interleave.

Under `python -u` (which the deepspeed launcher uses) `print` writes the text and its newline in
two system calls; two ranks' lines then glue together ("{...}{...}\\n\\n")."""

import os


def say(line: str, fd: int = 1) -> None:
    os.write(fd, (line + "\n").encode())
