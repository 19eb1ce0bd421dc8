"""Where `diffexp eval` writes into a run, as `diffexp compare` reads it back: here, so that compare reads it
without importing the evaluations."""

#: a run's folder of `diffexp eval` outputs (<run>/eval/, beside checkpoints/)
EVAL_DIR = "eval"
#: the file each evaluation writes its scalars to there, <results name>.scalars.json (sweep.runs reads them)
EVAL_SCALARS_SUFFIX = ".scalars.json"
#: what `diffexp eval harness` writes there (evals/tasks/harness.py), which compare's Table 2 reads
HARNESS_RESULTS_FILE = "harness.json"
