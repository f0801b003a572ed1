"""Worker scripts the notebooks launch with `zero_lab.launch.torchrun` (one process per rank).

Each is a plain script: it calls `init_worker()`, does its rank's work and `report()`s a
JSON-serialisable dict. Run one by hand with
`torchrun --standalone --nproc-per-node 2 -m zero_lab.workers.<name>` or through the launcher.
"""
