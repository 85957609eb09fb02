"""The step machine: what happens from a forward to the optimizer step, at the step boundary and
across ranks, and the scalars recorded along the way."""
