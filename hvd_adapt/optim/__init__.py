"""The distributed optimizer, the gradient noise scale it measures, and the
learning-rate scaling rules it applies (see each module)."""
