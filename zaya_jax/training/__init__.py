"""The pieces of a training run: the train state and step, checkpoints, what a resume may
change, faults, the event log, metrics and routing telemetry."""
