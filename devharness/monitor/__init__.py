"""The driver's side of debugging: reading every rank's state, history, stacks and logs without its help
(workers.py, stacks.py), who waits for whom (hang.py), and layer-by-layer comparison of layouts (check.py).
The worker's side (what each rank publishes, breakpoints, the debugger) is in devharness/debug/."""
