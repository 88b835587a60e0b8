"""The one home of what the tests share: paths of the shipped inputs (paths), tiny recipes, resolved
recipes from the real planner and compiler and hardware presets (recipes), CLI processes and their
outputs (processes), run directories for merge/push/generate (run_dirs), the session's trained runs
(trained_run), building them once for all pytest-xdist workers (once), the fake Hub (fakehub), a local
Slurm cluster (slurm_cluster), packed attention inputs (attention), and a stand-in rank entry point for
launcher tests (dist_probe)."""
