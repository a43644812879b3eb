"""Process checks that tests share."""


def alive(pid):
    """Whether process ``pid`` exists and is not a zombie (a killed child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
