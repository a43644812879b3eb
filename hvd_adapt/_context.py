"""The State that epoch loops and loaders consult: the most recent one made.

One explicit pointer, set by ``State.__init__`` and by ``run``, instead of
counters spread over modules.
"""
_current = None


def set_state(state):
    global _current
    _current = state


def get_state():
    return _current
