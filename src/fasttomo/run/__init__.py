"""One run's assembly: build, the run folder, outputs, resume, preflight, stop, the pipeline."""
