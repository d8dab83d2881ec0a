"""Running a schedule: materialisation and build, meshes and launching, collectives, RNG,
the pipeline split and runtime, checkpoint and weight I/O, the training step (``loop``)
(uses ``core`` and ``graph``)."""
