"""The process around the code: one-line user errors, signals, host memory, XLA flags, GPU
targets and plugins without a GPU, a step's memory against the devices', output directories
and the workdir lock."""
