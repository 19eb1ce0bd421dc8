"""`diffexp bench`: what each attention variant costs relative to the reference variant, measured side by side.

`train_step`, `decode` and `kernel` are the kinds of measurement and share the other modules; `trainer` and
`data` stand apart. How and why it measures as it does: bench/README.md.
"""
