"""Every entry point (reconstruct, simulate, evaluate, trace) and the one help and error front; the only code that imports Hydra."""
