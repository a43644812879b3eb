"""Argument checks whose errors name the argument, the bad value and what is allowed."""
import numbers
import os


def is_int(value):
    """True for ints (numpy's too), False for bools and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name, value, low, high=None):
    """Raise ValueError unless ``value`` is an int (not a bool) in [low, high]."""
    if not is_int(value) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")


def check_bool(name, value):
    """Raise ValueError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def seconds_from_environment(name, default):
    """``float(os.environ[name])``, or ``default`` where it is unset; raise ValueError,
    naming the variable and its value, unless that is a number of seconds > 0."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0, got {text!r}")
    return value
