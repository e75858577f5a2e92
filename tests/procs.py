"""Process state read from /proc, for tests that check what a run left running."""

from pathlib import Path


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not: it has exited, unreaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
