"""`diffexp bench`: what each attention variant costs relative to the reference variant, measured side by side.

One module per concern: `train_step`, `decode` and `kernel` are the three kinds of measurement;
`timing` (the interleaved, rotated timing loop and the ratios), `memory` (peak live tensor bytes),
`workload` (configs and inputs from the flags), `options` (the shared flags and their checks),
`report` (environment, JSON, tables, --compare), `plot` (the training-step figure), `progress` (stderr) and
`cli` (`diffexp bench KIND`)
are shared by all three. Variants come from the registry (diffexp.model.attention): a newly
registered variant is benchmarked without any change here.
"""
